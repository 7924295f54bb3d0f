"""`make docs`: every part of a page that the code determines, made by the code. It reruns each command whose
output a page shows (`<!-- output of the command above -->`), fills the Default column of pretrain_gpt.py's flag
tables from its parser, and writes each `<!-- generated: NAME -->` part; `--check` changes nothing and lists what
differs (tests/test_docs.py runs it, with the commands' checks: a change that moves a figure updates the page or
fails the suite).

    python -m tests.docs.update            # rewrite the pages
    python -m tests.docs.update --check    # exit 1 and say which parts are stale
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys

from tests.cli import ROOT
from tests.docs.commands import parse, run, shell_lines
from tests.docs.markdown import generated_parts, output_blocks, pages, read, table_rows

FLAG_TABLE = ("flag", "default", "meaning")  # a table of pretrain_gpt.py's flags: its Default column is generated
# What changes from run to run: masked in a sample output.
MASKS = [(re.compile(r"peak RSS \d+ MiB"), "peak RSS … MiB"), (re.compile(r"\| [\d.]+ s$", re.M), "| … s")]


@functools.lru_cache(maxsize=None)  # a command shown on two pages runs once
def _masked_stdout(command_line: str) -> tuple[str, ...]:
    command = parse(command_line)
    assert command is not None and not command.launcher_args, f"run it without torchrun: {command_line}"
    code, out, _ = run(command.program, list(command.args))
    assert code == 0, f"{command_line} exited {code}"
    for pattern, replacement in MASKS:
        out = pattern.sub(replacement, out)
    return tuple(out.rstrip("\n").split("\n"))


def command_output(command_line: str, lines_slice: tuple[int, int] | None) -> list[str]:
    """What the command prints on stdout (run in this process), volatile figures masked, cut to `lines_slice`."""
    lines = list(_masked_stdout(command_line))
    return lines[lines_slice[0] - 1:lines_slice[1]] if lines_slice else lines


def default_cell(action: argparse.Action) -> str:
    """A flag's default as its table shows it: `off` for a switch, `required`, `-` for none, else the value."""
    from mpzero.cli.arguments import REQUIRED
    if action.nargs == 0:
        return "off"
    if action.dest in REQUIRED:
        return "required"
    if action.default is None:
        return "-"
    return " ".join(map(str, action.default)) if isinstance(action.default, list) else str(action.default)


def flag_actions() -> dict[str, argparse.Action]:
    """pretrain_gpt.py's flags: {option string: its action}."""
    from mpzero.cli.arguments import build_parser
    return {option: action for action in build_parser()._actions for option in action.option_strings
            if action.dest != "help"}


def megatron_table() -> list[str]:
    """docs/megatron.md's table: each Megatron-LM flag mpzero does not have, with what to use instead."""
    from mpzero.cli.megatron_flags import NOT_IN_MPZERO
    flags_by_advice: dict[str, list[str]] = {}  # one row per answer, its flags in the table's order
    for flag, advice in NOT_IN_MPZERO.items():
        flags_by_advice.setdefault(advice, []).append(f"`{flag}`")
    return ["| Megatron-LM flags | in mpzero |", "|---|---|"] + [
        f"| {', '.join(flags)} | {advice} |" for advice, flags in flags_by_advice.items()]


def megatron_example() -> list[str]:
    """docs/megatron.md's example: what a Megatron-LM flag mpzero lacks answers, as pretrain_gpt.py prints it."""
    from mpzero.cli.megatron_flags import NOT_IN_MPZERO
    assert "--train-samples" in NOT_IN_MPZERO
    code, _, err = run("pretrain_gpt.py", ["--train-samples", "1000000"])
    assert code == 2 and err.count("\n") == 1, err
    return ["```text", "$ python pretrain_gpt.py ... --train-samples 1000000", err.rstrip("\n"), "```"]


GENERATORS = {"megatron-flags": megatron_table, "megatron-example": megatron_example}


def replacements(page: str, lines: list[str]) -> list[tuple[int, int, list[str], str]]:
    """[(first, end, new lines, what)]: lines[first:end] as the code makes them now."""
    out = []
    for command_block, output, lines_slice in output_blocks(page, lines):
        command_line = shell_lines(command_block.text)[-1]
        out.append((output.first, output.last, command_output(command_line, lines_slice),
                    f"{output.where}: the output of `{command_line[:60]}...`"))
    for name, first, end in generated_parts(page, lines):
        assert name in GENERATORS, f"{page}:{first}: no generator {name!r}"
        out.append((first, end, GENERATORS[name](), f"{page}:{first}: the generated part {name}"))
    actions = flag_actions() if table_rows(lines, FLAG_TABLE) else {}
    for index, cells in table_rows(lines, FLAG_TABLE):
        flags = re.findall(r"`(--[a-z0-9-]+)`", cells[0])
        assert flags and all(f in actions for f in flags), f"{page}:{index + 1}: pretrain_gpt.py has no {cells[0]}"
        new = f"| {cells[0]} | {default_cell(actions[flags[0]])} | {' | '.join(cells[2:])} |"
        out.append((index, index + 1, [new], f"{page}:{index + 1}: the default of {flags[0]}"))
    return out


def update(page: str, write: bool) -> list[str]:
    """The stale parts of `page` (rewritten in place when `write`)."""
    lines = read(page)
    stale, new_lines = [], list(lines)
    for first, end, new, what in sorted(replacements(page, lines), key=lambda r: r[0], reverse=True):
        if lines[first:end] != new:
            stale.append(what)
            new_lines[first:end] = new
    if write and stale:
        with open(os.path.join(ROOT, page), "w", encoding="utf-8") as f:
            f.write("\n".join(new_lines))
    return stale[::-1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Make the parts of the documentation that the code determines.")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a part is stale")
    args = p.parse_args(argv)
    stale = [what for page in pages() for what in update(page, write=not args.check)]
    for what in stale:
        print(f"{'stale' if args.check else 'updated'}: {what}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
