"""Checkpoints that verify themselves (issue 16, items 6 and 7): a flipped bit in a stored chunk is found on load
and by `tools/checkpoint_util.py verify`, naming the file and the key; a damaged or missing file is one line
naming the checkpoint, the file and the previous iteration; checkpoint_util on garbage is one line too."""

import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from tests.cli import ROOT, TINY, exit_code_and_stderr, main_capturing_stdout, quiet_main
from tests.distributed import run_ranks

TOOL = [sys.executable, os.path.join(ROOT, "tools", "checkpoint_util.py")]
ARGV = TINY + ["--eval-iters", "0", "--zero-stage", "2", "--train-iters", "4", "--save-interval", "2"]
LATEST = "iter_0000004"
PREVIOUS = "iter_0000002"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real 2-rank ZeRO-2 checkpoint, iterations 2 and 4."""
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    run_ranks(2, quiet_main, ARGV + ["--save", str(root)])
    return root


@pytest.fixture
def ckpt(saved, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    return root


def _load(root, world=2, layout=()):
    """(exit code, stderr) of every rank resuming from `root`."""
    return run_ranks(world, exit_code_and_stderr, ARGV + list(layout) + ["--load", str(root), "--train-iters", "5"])


def _tool(*args):
    return subprocess.run(TOOL + list(args), capture_output=True, text=True)


def _flip_a_bit_in_a_chunk(directory, shard):
    """Flip an exponent bit in the middle of the data of the largest chunk stored in `shard`; returns its key."""
    metadata = FileSystemReader(str(directory)).read_metadata()
    index, info = max(((i, s) for i, s in metadata.storage_data.items() if s.relative_path == shard),
                      key=lambda item: item[1].length)
    path = directory / shard
    data = bytearray(path.read_bytes())
    stored = torch.load(io.BytesIO(bytes(data[info.offset:info.offset + info.length])), weights_only=True)
    values = stored.contiguous().numpy().tobytes()
    at = data.find(values, info.offset, info.offset + info.length)
    assert at >= 0
    at += (len(values) // 8) * 4 + 3  # the high byte of a float32 in the middle
    data[at] ^= 0x40
    path.write_bytes(bytes(data))
    return index.fqn


@pytest.mark.parametrize("world,layout", [(2, ()), (4, ("--zero-stage", "3"))])
def test_a_flipped_bit_in_a_shard_is_one_line_naming_file_and_key(ckpt, world, layout):
    """At the saving layout each rank reads its own chunks whole; at DP 4 every stored chunk is split between
    two ranks, which read it whole into a scratch buffer to check it."""
    key = _flip_a_bit_in_a_chunk(ckpt / LATEST, "__1_0.distcp")
    expected = (f"error: checkpoint {ckpt / LATEST}: __1_0.distcp holds a damaged chunk of {key} at ")
    for code, stderr in _load(ckpt, world, layout):
        assert code == 2 and stderr.startswith(expected) and stderr.count("\n") == 1, stderr
        assert f"crc32c mismatch): load the previous iteration ({PREVIOUS}: put 2 in " in stderr
    found = _tool("verify", "--load", str(ckpt))
    assert found.returncode == 2 and found.stderr.startswith(expected) and found.stderr.count("\n") == 1
    assert found.stdout == ""
    again = _tool("to-consolidated", "--load", str(ckpt), "--output", str(ckpt.parent / "w.pt"))
    assert again.returncode == 2 and again.stderr.startswith(expected) and not os.path.exists(ckpt.parent / "w.pt")
    previous = _tool("verify", "--load", str(ckpt), "--iteration", "2")
    assert previous.returncode == 0 and previous.stdout.startswith(f"OK: checkpoint {ckpt / PREVIOUS}: ")
    assert previous.stderr == ""  # no DCP warning about the missing process group


def test_an_intact_checkpoint_verifies_and_loads(ckpt):
    result = _tool("verify", "--load", str(ckpt))
    assert result.returncode == 0 and result.stderr == "" and " verified (crc32c); " in result.stdout
    history, stdout = run_ranks(2, main_capturing_stdout, ARGV + ["--load", str(ckpt), "--train-iters", "5"])[0]
    assert "at iteration 4" in stdout and len(history["losses"]) == 1 and "checksums" not in stdout


def _truncate(path):
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


@pytest.mark.parametrize("damage,name,problem", [
    (_truncate, ".metadata", "is unreadable"),
    (os.remove, ".metadata", "is missing"),
    (_truncate, "meta.json", "is unreadable (not valid JSON)"),
    (os.remove, "rng/rank_00001.pt", "is missing"),
    (_truncate, "rng/rank_00000.pt", "is unreadable"),
    (os.remove, "__1_0.distcp", "is missing"),
    (_truncate, "__0_0.distcp", "is truncated"),
    (_truncate, "checksums/rank_00001.json", "is unreadable (damaged)"),
])
def test_a_damaged_or_missing_file_is_one_line_naming_it(ckpt, damage, name, problem):
    damage(ckpt / LATEST / name)
    expected = f"error: checkpoint {ckpt / LATEST}: {name} {problem}"
    for code, stderr in _load(ckpt):  # rank 1's own RNG file: rank 0 stops too, instead of waiting
        assert code == 2 and stderr.startswith(expected) and stderr.count("\n") == 1, stderr
        assert f"load the previous iteration ({PREVIOUS}: put 2 in {ckpt / 'latest_checkpointed_iteration.txt'})" \
            in stderr
    found = _tool("verify", "--load", str(ckpt))
    assert found.returncode == 2 and found.stderr.startswith(expected) and found.stderr.count("\n") == 1


def test_without_an_earlier_checkpoint_the_line_says_so(ckpt):
    shutil.rmtree(ckpt / PREVIOUS)
    (ckpt / LATEST / "meta.json").write_text("{")
    code, stderr = _load(ckpt, world=1, layout=("--zero-stage", "1"))[0]
    assert code == 2 and stderr == (f"error: checkpoint {ckpt / LATEST}: meta.json is unreadable (not valid JSON): "
                                    f"restore it from a copy; there is no earlier checkpoint under {ckpt}\n")


def test_a_checkpoint_without_checksums_loads_unverified(ckpt):
    """Format 2 (written before checksums): no checksums/ and no "checksums" in meta.json."""
    shutil.rmtree(ckpt / LATEST / "checksums")
    meta_path = ckpt / LATEST / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta.pop("checksums")
    meta_path.write_text(json.dumps({**meta, "format": 2}))
    history, stdout = run_ranks(2, main_capturing_stdout, ARGV + ["--load", str(ckpt), "--train-iters", "5"])[0]
    assert "at iteration 4" in stdout and len(history["losses"]) == 1
    assert f"note: {ckpt / LATEST} has no checksums (format 2): loaded unverified" in stdout
    result = _tool("verify", "--load", str(ckpt))
    assert result.returncode == 0 and "read (no checksums: format 2" in result.stdout


@pytest.mark.parametrize("command", ["verify", "to-consolidated"])
def test_checkpoint_util_on_garbage_is_one_line(tmp_path, command):
    extra = ["--output", str(tmp_path / "w.pt")] if command == "to-consolidated" else []
    (tmp_path / "empty").mkdir()
    empty = _tool(command, "--load", str(tmp_path / "empty"), *extra)
    assert empty.returncode == 2 and empty.stderr.startswith(f"error: no mpzero checkpoint under {tmp_path / 'empty'}")
    garbage = tmp_path / "garbage"
    (garbage / "iter_0000007").mkdir(parents=True)
    (garbage / "latest_checkpointed_iteration.txt").write_text("7")
    (garbage / "iter_0000007" / "meta.json").write_text(json.dumps({"iteration": 7, "shapes": {}, "layout": {}}))
    (garbage / "iter_0000007" / ".metadata").write_bytes(os.urandom(300))
    (garbage / "iter_0000007" / "__0_0.distcp").write_bytes(os.urandom(300))
    result = _tool(command, "--load", str(garbage), *extra)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"error: checkpoint {garbage / 'iter_0000007'}: .metadata is unreadable (")
    assert result.stderr.count("\n") == 1, result.stderr  # no traceback, no DCP warning


def test_from_consolidated_on_garbage_is_one_line(tmp_path):
    (tmp_path / "w.pt").write_bytes(os.urandom(1000))
    result = _tool("from-consolidated", "--input", str(tmp_path / "w.pt"), "--save", str(tmp_path / "out"))
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"error: --input {tmp_path / 'w.pt'} is not a consolidated checkpoint (")
