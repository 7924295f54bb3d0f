"""Every flag of every entry point, fed the values that break programs (issue 23, item 6): for each flag that
takes a value, a table of bad values chosen by its declared type (0, -1, nan, inf, 1e400, "", "abc", 64.0 for
numbers; "", a directory, a missing file, a non-UTF-8 file, a path under a file for paths; ...), run
in-process through the entry point's own `main(argv)`: a non-zero exit, no traceback, exactly one `error:`
line naming the flag, and nothing created. A value the flag's declared range admits (0 for --eval-iters) is
known from the flag's type, not from a list here.

The entry points are found by construction: pretrain_gpt.py and every tools/*.py with a `main(argv)`; each
main is run once with its argparse parse call intercepted to get its parser (and a subcommand's), so a new
tool or a new flag is covered without editing this file. A flag whose type is not one of mpzero/cli/checks.py's
(a bare int, float or str) fails here: that is how every flag goes through the one validation layer.
"""

import argparse
import contextlib
import glob
import io
import math
import os
import runpy
import subprocess
import sys
from unittest import mock

import pytest

from mpzero.cli.checks import Choice, Items, Number, Path, Size, Text
from tests.cli import ROOT, fuzz_outcome, tree_snapshot

SCRIPTS = [os.path.join(ROOT, "pretrain_gpt.py")] + sorted(glob.glob(os.path.join(ROOT, "tools", "*.py")))
NUMBERS = ["0", "-1", "nan", "inf", "1e400", "", "abc", "64.0", "٢"]  # the last: a digit int() reads, not ASCII


class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


def _parser_of(main) -> argparse.ArgumentParser:
    """The parser main(argv) parses with: its first parse call, intercepted before anything else runs."""
    def intercept(self, args=None, namespace=None):
        raise _Parsed(self)
    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", intercept), \
            contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(["--help"])
        except _Parsed as parsed:
            return parsed.parser
    raise AssertionError("main(argv) parsed no flags")


def _entry_points() -> list[tuple[str, object, list[str], argparse.ArgumentParser]]:
    """(name, main, argv prefix, parser) for every entry point and subcommand."""
    found = []
    for script in SCRIPTS:
        main = runpy.run_path(script).get("main")
        if main is None:
            continue
        name = os.path.relpath(script, ROOT)
        parser = _parser_of(main)
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if subs:
            found += [(f"{name} {command}", main, [command], sub) for command, sub in subs[0].choices.items()]
        else:
            found.append((name, main, [], parser))
    return found


def _admits(kind: Number, text: str) -> bool:
    """Whether the flag's declared range holds `text` (read as the number it spells, ASCII digits only)."""
    if not text.isascii():
        return False
    try:
        value = float(text) if kind.kind is float else int(text)
    except ValueError:
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    low = kind.low is None or value > kind.low or (value == kind.low and kind.low_ok)
    high = kind.high is None or value < kind.high or (value == kind.high and kind.high_ok)
    return low and high


def _paths(tmp) -> dict[str, str]:
    os.makedirs(os.path.join(tmp, "a-directory"), exist_ok=True)
    with open(os.path.join(tmp, "a-file.txt"), "w") as f:
        f.write("text\n")
    with open(os.path.join(tmp, "not-utf8.txt"), "wb") as f:
        f.write(b"caf\xe9 \xff\xfe\n")
    return {"dir": os.path.join(tmp, "a-directory"), "file": os.path.join(tmp, "a-file.txt"),
            "missing": os.path.join(tmp, "missing", "thing"), "not_utf8": os.path.join(tmp, "not-utf8.txt"),
            "under_file": os.path.join(tmp, "a-file.txt", "child")}


def _bad_values(action: argparse.Action, paths: dict[str, str]) -> list[str]:
    """The values this flag must refuse, by its declared type (and choices)."""
    kind = action.type
    if action.choices is not None:
        candidates = ["abc", "", "-1", "99"]
        return [v for v in candidates if not _converts_into(kind, v, action.choices)]
    if isinstance(kind, Number):  # Size too: a bare number is GiB, so the sign and finiteness are the number's
        return [v for v in NUMBERS if not _admits(kind, v)]
    if isinstance(kind, Items):
        item = kind.item
        lists = ["", ",", "1,,2", "abc", "0", "-1", "nan", "1,abc"]
        if isinstance(item, Number):
            return [v for v in lists if not (v and all(p and _admits(item, p) for p in v.split(",")))]
        return [v for v in lists if not (v and all(p in item.values for p in v.split(",")))]
    if isinstance(kind, Text):
        return [] if kind.empty_ok else [""]
    if isinstance(kind, Path):
        if kind.exists:
            wrong = {"file": [paths["dir"]], "dir": [paths["file"]], "any": []}[kind.kind]
            return ["", paths["missing"]] + wrong + ([paths["not_utf8"]] if kind.text else [])
        wrong = {"file": [paths["dir"]], "dir": [paths["file"]], "any": []}[kind.kind]
        return ["", paths["under_file"]] + wrong
    raise AssertionError(f"{action.option_strings[0]} takes a value of type {kind!r}, not one of mpzero/cli/checks.py's "
                         f"(Number, Size, Path, Text, Items): declare its range or kind there")


def _converts_into(kind, text: str, choices) -> bool:
    try:
        value = kind(text) if kind is not None else text
    except Exception:  # noqa: BLE001 - refused by the type: not admitted
        return False
    return value in choices


def _cases(tmp):
    paths = _paths(tmp)
    cases = []
    for name, main, prefix, parser in _entry_points():
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0 or action.dest == "help":
                continue
            flag = action.option_strings[0]
            for value in _bad_values(action, paths):
                cases.append((name, main, prefix + [f"{flag}={value}"], action))
    return cases




def _check(name, argv, action, code, stderr):
    flags = action.option_strings
    lines = stderr.splitlines()
    assert code not in (0, None), f"{name} {argv}: accepted"
    assert "Traceback" not in stderr, f"{name} {argv}: {stderr}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{name} {argv}: {stderr!r}"
    assert any(flag in lines[0] for flag in flags), f"{name} {argv}: the line names no flag of {flags}: {stderr!r}"


def test_every_flag_refuses_every_bad_value_in_one_line_creating_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative outputs would land here
    cases = _cases(str(tmp_path))
    before = tree_snapshot(tmp_path)
    failures = []
    for name, main, argv, action in cases:
        code, stderr = fuzz_outcome(main, argv)
        try:
            _check(name, argv, action, code, stderr)
            assert tree_snapshot(tmp_path) == before, f"{name} {argv}: created {tree_snapshot(tmp_path) - before}"
        except AssertionError as failure:
            failures.append(str(failure))
    entry_points = {name for name, *_ in cases}
    flags = {(name, action.dest) for name, _, _, action in cases}
    print(f"fuzz: {len(entry_points)} entry points x {len(flags)} flags -> {len(cases)} bad values")
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures[:40])
    assert len(entry_points) >= 10 and len(cases) >= 500  # every tool and subcommand was found


def test_a_flag_of_a_bare_type_is_caught():
    parser = argparse.ArgumentParser()
    action = parser.add_argument("--count", type=int)
    with pytest.raises(AssertionError, match="--count takes a value of type"):
        _bad_values(action, {})


def test_declared_ranges_decide_what_is_admitted():
    assert _bad_values(argparse.Action(["--n"], "n", type=Number(int, low=0)), {}) == \
        ["-1", "nan", "inf", "1e400", "", "abc", "64.0", "٢"]
    assert "0" in _bad_values(argparse.Action(["--n"], "n", type=Number(int, low=1)), {})
    assert _bad_values(argparse.Action(["--s"], "s", type=Size()), {})[0] == "0"
    assert _bad_values(argparse.Action(["--c"], "c", type=Items(Choice(("a",)))), {}) == \
        ["", ",", "1,,2", "abc", "0", "-1", "nan", "1,abc"]


@pytest.mark.parametrize("script,argv,flag", [
    ("pretrain_gpt.py", ["--num-layers=64.0"], "--num-layers"),
    ("tools/checkpoint_util.py", ["verify", "--load=missing-run"], "--load"),
    ("tools/plan_memory.py", ["--world-size=8", "--device-memory=nan"], "--device-memory"),
    ("tools/generate.py", ["--load=.", "--top-p=0"], "--top-p"),
])
def test_a_sample_through_real_processes(tmp_path, script, argv, flag):
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, script), *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {flag} "), proc.stderr
    assert os.listdir(tmp_path) == []
