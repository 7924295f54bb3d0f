"""The commands a page shows, held to the code: each command of a ```sh block is split into its program and
arguments; a program of this repository (pretrain_gpt.py, tools/, bench/, examples/) must exist and run `--help`
(in this process, its parser caught as it prints the help), and every flag the command names must be one of that
parser's; torchrun's own flags are checked against torchrun's parser, `make` targets against the Makefile and
`pip install -e '.[extra]'` extras against setup.py. A program outside the repository must be in EXTERNAL.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
import re
import runpy
import shlex
import sys
from dataclasses import dataclass

from tests.cli import ROOT

PYTHONS = {"python", "python3", ".venv/bin/python", "$PY"}
WRAPPERS = {"srun", "time", "nice"}  # run what follows: checked as the command itself
# Programs not this repository's (pip: what it installs is checked only for mpzero's own extras).
EXTERNAL = {"tensorboard", ".venv/bin/tensorboard", "source", "wandb", "nsys", "git", "cd", "scontrol", "head",
            "mkdir", "ls", "uptime", "nvidia-smi", "sbatch", "export", "pip"}
NO_HELP = {"bench/structure.py"}  # takes a checkout's path as its one argument, no flags
WITH_TRAINING_FLAGS = {"tools/plan_memory.py"}  # its own flags, and pretrain_gpt.py's for the job it plans
SEPARATORS = re.compile(r"\s(?:&&|\|\||\||;)\s")
PLACEHOLDER = re.compile(r"<[^<>]*>")  # <the model flags import_hf.py prints>


@dataclass(frozen=True)
class Command:
    """One command: `program` (a repository path, a module as `-m name`, `torchrun`, `make`...) and its arguments;
    `launcher_args`: torchrun's own, before the script."""

    program: str
    args: tuple[str, ...]
    launcher_args: tuple[str, ...] = ()

    @property
    def flags(self) -> list[str]:
        return [token.split("=", 1)[0] for token in self.args if token.startswith("--")]

    @property
    def subcommand(self) -> tuple[str, ...]:
        """checkpoint_util.py's `verify` and the like: the leading arguments that are no flags."""
        out = []
        for token in self.args:
            if token.startswith("-"):
                break
            out.append(token)
        return tuple(out)


def shell_lines(text: str) -> list[str]:
    """A ```sh block's commands: continuation lines joined, comment lines and `#!` dropped, `a && b` split."""
    joined, pending = [], ""
    for line in text.split("\n"):
        pending += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            joined.append(pending)
            pending = ""
    commands = []
    for line in joined:
        if line.strip() and not line.strip().startswith("#"):
            commands += [part for part in SEPARATORS.split(line) if part.strip()]
    return commands


def parse(line: str) -> Command | None:
    """The command a shell line runs, or None for a variable assignment alone; AssertionError if unknown."""
    if re.match(r"^\s*[A-Za-z_][A-Za-z0-9_]*=\$\(", line):  # head=$(scontrol ...): a shell variable, not a program
        return None
    tokens = [t.strip("[]") for t in shlex.split(PLACEHOLDER.sub(" ", line), comments=True)]
    tokens = [t for t in tokens if t and t != "..."]
    while tokens and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tokens[0]) or tokens[0] in WRAPPERS):
        tokens = tokens[3:] if tokens[:2] == ["nice", "-n"] else tokens[1:]  # VAR=value, srun, time, nice -n 10
    if not tokens:
        return None
    first, rest = tokens[0], tokens[1:]
    if first in PYTHONS:
        if rest[:2] == ["-m", "torch.distributed.run"]:
            return _torchrun(rest[2:])
        if rest[:2] == ["-m", "pip"]:
            return Command("pip", tuple(rest[2:]))
        if rest[:1] == ["-m"]:
            return Command(f"-m {rest[1]}", tuple(rest[2:]))
        return Command(rest[0], tuple(rest[1:]))
    if first == "torchrun":
        return _torchrun(rest)
    if first in ("make", "bash") or first.endswith(".py") or first in EXTERNAL:
        return Command(first, tuple(rest))
    raise AssertionError(f"a program the docs check does not know: {first!r} (add it to EXTERNAL if it is "
                         f"not this repository's)")


@functools.lru_cache(maxsize=1)
def _torchrun_options() -> dict[str, int]:
    """torchrun's flags: {option: how many values it takes (0 or 1)}."""
    from torch.distributed.run import get_args_parser
    return {option: 0 if action.nargs == 0 else 1 for action in get_args_parser()._actions
            for option in action.option_strings}


def _torchrun(tokens: list[str]) -> Command:
    options, index = _torchrun_options(), 0
    while index < len(tokens) and tokens[index].startswith("-"):
        name = tokens[index].split("=", 1)[0]
        assert name in options, f"torchrun has no flag {name}"
        index += 1 + (options[name] if "=" not in tokens[index] else 0)
    assert index < len(tokens), "torchrun without a script"
    return Command(tokens[index], tuple(tokens[index + 1:]), tuple(tokens[:index]))


def problems(command: Command) -> list[str]:
    """What is wrong with the command: a missing program, target or extra, a flag its parser does not have."""
    if command.program == "make":
        targets = set(re.findall(r"^([\w.-]+):", _text("Makefile"), re.M))
        return [f"make has no target {t}" for t in command.args if "=" not in t and t not in targets]
    if command.program == "pip":
        extras = re.findall(r"\.\[([\w,]+)\]", " ".join(command.args))
        known = set(re.findall(r'"(\w+)": \[', _text("setup.py")))
        return [f"setup.py has no extra {e}" for group in extras for e in group.split(",") if e not in known]
    if command.program in EXTERNAL:
        return []
    if command.program == "bash":
        return [] if os.path.isfile(os.path.join(ROOT, command.args[0])) else [f"no file {command.args[0]}"]
    if not command.program.startswith("-m ") and not os.path.isfile(os.path.join(ROOT, command.program)):
        return [f"no file {command.program}"]
    if command.program in NO_HELP:
        return [f"{command.program} takes no flags"] if command.flags else []
    known = options(command.program, command.subcommand)
    if command.program in WITH_TRAINING_FLAGS:
        known |= options("pretrain_gpt.py")
    return [f"{command.program} has no flag {flag}" for flag in command.flags if flag not in known]


def _text(name: str) -> str:
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


@functools.lru_cache(maxsize=None)
def options(program: str, subcommand: tuple[str, ...] = ()) -> frozenset[str]:
    """The flags of `program` (a path, or `-m module`): it is run with `--help` in this process, and the parser that
    prints the help is the one asked."""
    printed = []
    print_help = argparse.ArgumentParser.print_help

    def record(parser, file=None):
        printed.append(parser)
        return print_help(parser, file)

    argparse.ArgumentParser.print_help = record
    try:
        code = run(program, list(subcommand) + ["--help"])[0]
    finally:
        argparse.ArgumentParser.print_help = print_help
    assert code == 0 and printed, f"{program} {' '.join(subcommand)} --help did not print its help (exit {code})"
    return frozenset(o for action in printed[-1]._actions for o in action.option_strings)


def run(program: str, argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `python program argv` (or `python -m module argv`) run in this process."""
    out, err = io.StringIO(), io.StringIO()
    saved, saved_path = sys.argv, list(sys.path)
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if program.startswith("-m "):
                sys.argv = [program[3:]] + argv
                runpy.run_module(program[3:], run_name="__main__", alter_sys=True)
            else:  # as `python path` runs it: its folder first on the path (bench/'s scripts import their siblings)
                sys.argv = [program] + argv
                sys.path.insert(0, os.path.dirname(os.path.join(ROOT, program)))
                runpy.run_path(os.path.join(ROOT, program), run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
    finally:
        sys.argv = saved
        sys.path[:] = saved_path
    return code, out.getvalue(), err.getvalue()
