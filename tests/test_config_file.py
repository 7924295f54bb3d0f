"""mpzero/cli/config_file.py against every key a --config file can set (issue 42, items 2 and 4): each of
pretrain_gpt.py's flags (found from its parser: a new flag is covered without editing this file) as a YAML key
given `KEY:` (null), an alias, a huge string and a huge list, and the alias bomb and oversized files on their own:
  - null is the flag's default: the parsed flags equal those of the same command without the key (or the same one
    line where the flag is required);
  - an alias is refused in one line naming it, before any value is built;
  - a huge value is accepted or refused in one line of bounded length (the value quoted as an excerpt).
The run after parsing is the command line's: what the parsed flags equal, the run does (tests/test_validation.py
and the fuzz tests run them)."""

import contextlib
import io
import os
import tempfile
import time

import pytest

from mpzero.cli.arguments import build_parser, parse_args, run_config
from mpzero.cli.config_file import MAX_BYTES
from mpzero.errors import ConfigError
from tests.cli import TINY, exit_code_and_stderr

KEYS = sorted({a.option_strings[0].lstrip("-") for a in build_parser()._actions
               if a.option_strings and a.dest not in ("help", "config")})
LONGEST_LINE = 600  # an error line quoting a huge value stays this short


@pytest.fixture(autouse=True)
def wandb_imports_into_tmp_path(tmp_path, monkeypatch):
    """--wandb-project set by a key imports wandb, whose import makes temporary folders: here, not the system's."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def _without(argv, key):
    """TINY less the flag `key` (and its value), so the file's value is the one parsed."""
    out, k = [], 0
    while k < len(argv):
        if argv[k] == f"--{key}":
            k += 1 if k + 1 < len(argv) and argv[k + 1].startswith("--") else 2  # a switch, or a flag and its value
            continue
        out.append(argv[k])
        k += 1
    return out


def _outcome(argv):
    """The parsed and resolved flags (as a dict), or the ConfigError's line."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = parse_args(argv)
            run_config(args, 1)
        return {dest: value for dest, value in vars(args).items() if dest != "config"}
    except ConfigError as error:
        return str(error)


def _config(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return ["--config", str(path)]


def test_every_key_given_null_is_its_flags_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outputs a default names land here
    for key in KEYS:
        base = _without(TINY, key)
        assert _outcome(base + _config(tmp_path, f"{key}:\n")) == _outcome(base), key
    print(f"null: {len(KEYS)} keys")


def test_every_key_given_an_alias_is_refused_before_it_is_built(tmp_path):
    for key in KEYS:
        argv = _without(TINY, key) + _config(tmp_path, f"anchor: &x [1, 2]\n{key}: *x\n")
        outcome = _outcome(argv)
        assert isinstance(outcome, str) and "uses the YAML alias *x: aliases are not read" in outcome, (key, outcome)
    print(f"aliases: {len(KEYS)} keys")


HUGE = MAX_BYTES - 100  # the largest value a file under the limit can hold


# a string as long as the file allows, a list of 2,000 items (YAML's pure-Python value building takes ~1 s per 30,000
# scalars: the file limit bounds that too), an integer of 4,000 digits, a float beyond the largest
@pytest.mark.parametrize("value", ["'" + "x" * HUGE + "'", "[" + "1," * 2000 + "1]", "9" * 4000, "1e400"])
def test_every_key_given_a_huge_value_is_one_bounded_line_or_taken(tmp_path, monkeypatch, value):
    monkeypatch.chdir(tmp_path)
    refused = 0
    for key in KEYS:
        outcome = _outcome(_without(TINY, key) + _config(tmp_path, f"{key}: {value}\n"))
        if isinstance(outcome, str):
            assert "\n" not in outcome and len(outcome) < LONGEST_LINE, (key, len(outcome), outcome[:300])
            refused += 1
    print(f"huge value {value[:10]}...: {len(KEYS)} keys, {refused} refused in one line, the rest taken")


def test_an_alias_bomb_is_refused_at_once_in_one_line(tmp_path):
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{k}: &a{k} [" + ", ".join([f"*a{k - 1}"] * 9) + "]" for k in range(1, 12)]  # 9^12 leaves
    argv = _without(TINY, "num-layers") + _config(tmp_path, "\n".join(lines) + "\nnum-layers: [*a11]\n")
    start = time.monotonic()
    code, stderr = exit_code_and_stderr(argv)
    assert code == 2 and stderr.count("\n") == 1 and "uses the YAML alias *a0" in stderr, stderr
    assert time.monotonic() - start < 10


def test_a_file_over_the_limit_is_refused_unread(tmp_path):
    path = tmp_path / "run.yaml"
    with open(path, "wb") as f:
        f.truncate(MAX_BYTES + 1)  # sparse: nothing to read, and nothing is
    code, stderr = exit_code_and_stderr(TINY + ["--config", str(path)])
    assert code == 2 and stderr.count("\n") == 1 and "is over 64 KiB" in stderr, stderr
    assert os.path.getsize(path) == MAX_BYTES + 1
