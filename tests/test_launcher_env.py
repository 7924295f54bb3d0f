"""mpzero/launcher_env.py: the launcher's variables checked like flags (issue 42, item 4). Every variable of its
table (VARIABLES: one added there is tested here) is given the values that break programs, chosen by its type as
tests/test_fuzz_flags.py chooses a flag's, plus the combinations that disagree (a rank outside its world, a
world without its rank), through every entry point that reads them (pretrain_gpt.py, tools/generate.py): exit 2,
one `error:` line naming the variable, at once (no wait for peers). A lint holds every read of these variables
in mpzero/, tools/ and pretrain_gpt.py to launcher_env()."""

import ast
import glob
import os
import runpy
import time

import pytest

from mpzero.cli.checks import Number
from mpzero.launcher_env import VARIABLES
from tests.cli import ROOT, TINY, fuzz_outcome, tree_snapshot
from tests.test_fuzz_flags import NUMBERS, _admits

import pretrain_gpt

READERS = {"pretrain_gpt.py": (pretrain_gpt.main, TINY + ["--eval-iters", "0", "--train-iters", "1"]),
           "tools/generate.py": (runpy.run_path(os.path.join(ROOT, "tools", "generate.py"))["main"],
                                 ["--load", ROOT, "--prompt", "1", "--tokenizer-type", "NullTokenizer"])}
LAUNCHED = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}
DISAGREEING = {  # (variables, the one the line names)
    "a rank outside its world": ({**LAUNCHED, "WORLD_SIZE": "1", "RANK": "3"}, "RANK"),
    "a local rank outside its node": ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK"),
    "more local processes than the world": ({**LAUNCHED, "LOCAL_WORLD_SIZE": "4"}, "LOCAL_WORLD_SIZE"),
    "a world without its rank": ({"WORLD_SIZE": "2"}, "WORLD_SIZE"),
    "a world without its master": ({"WORLD_SIZE": "2", "RANK": "0"}, "WORLD_SIZE"),
}


def _bad_values(bounds) -> list[str]:
    """What the fuzz tests give an integer flag of this range (and one past each end), or an empty text."""
    if bounds is None:
        return ["", "   "]
    kind = Number(int, low=bounds[0], high=bounds[1], high_ok=True)
    return [v for v in NUMBERS + [str(bounds[0] - 1), str(bounds[1] + 1), "+1", "1_0"] if not _admits(kind, v)
            or not v.isdigit()]


def _cases():
    for name, kind in VARIABLES.items():
        for value in _bad_values(kind):
            yield f"{name}={value!r}", {**(LAUNCHED if name in LAUNCHED else {}), name: value}, name
    for label, (variables, named) in DISAGREEING.items():
        yield label, variables, named


@pytest.mark.parametrize("reader", sorted(READERS))
def test_every_bad_launcher_variable_is_one_line_at_once(tmp_path, monkeypatch, reader):
    main, argv = READERS[reader]
    monkeypatch.chdir(tmp_path)
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    failures, count = [], 0
    for label, variables, named in _cases():
        with monkeypatch.context() as env:
            for key, value in variables.items():
                env.setenv(key, value)
            start = time.monotonic()
            code, stderr = fuzz_outcome(main, argv)
            lines, seconds = stderr.splitlines(), time.monotonic() - start
        ok = (code == 2 and len(lines) == 1 and lines[0].startswith(f"error: environment variable {named}")
              and seconds < 5)
        if not ok:
            failures.append(f"{label}: exit {code} after {seconds:.1f} s: {stderr!r}")
        count += 1
    print(f"{reader}: {len(VARIABLES)} variables, {count} cases")
    assert not failures, "\n".join(failures)
    assert tree_snapshot(tmp_path) == set()


READS = ("environ", "getenv")


def _reads(source: str) -> list[tuple[int, str]]:
    """(line, variable) for every read of a launcher variable in `source`: os.environ[...], .get(...),
    os.getenv(...), `... in os.environ`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and node.value in VARIABLES:
            found.append((node.lineno, node.value))
    return found


def test_every_read_of_a_launcher_variable_goes_through_launcher_env():
    sources = [os.path.join(ROOT, "pretrain_gpt.py")] + glob.glob(os.path.join(ROOT, "mpzero", "**", "*.py"),
                                                                  recursive=True) \
        + glob.glob(os.path.join(ROOT, "tools", "*.py"))
    found = []
    for path in sources:
        if path.endswith(os.path.join("mpzero", "launcher_env.py")):
            continue
        with open(path, encoding="utf-8") as f:
            source = f.read()
        found += [f"{os.path.relpath(path, ROOT)}:{line} {name}" for line, name in _reads(source)
                  if any(word in source.splitlines()[line - 1] for word in READS)]
    assert not found, "read these through mpzero.launcher_env.launcher_env():\n" + "\n".join(found)
