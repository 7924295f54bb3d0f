"""The dataset index cache rebuilds itself (issue 16, item 8): a deleted, truncated or damaged .npy file (or a
description file without sizes and checksums) is found by rank 0 and rebuilt while the other ranks wait, and a
real run then trains on the same samples."""

import glob
import json
import os

import numpy as np
import pytest

from mpzero.data import IndexedDatasetBuilder
from mpzero.data.index_cache import load_or_build
from tests.cli import TINY, main_capturing_stdout
from tests.distributed import run_ranks


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _flip_a_byte(path):
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 0xFF  # the arrays' data, not the header: np.load alone would not notice
    open(path, "wb").write(bytes(data))


def _old_marker(marker):
    """What an mpzero before the checksums wrote: the description alone."""
    recorded = json.load(open(marker))
    open(marker, "w").write(json.dumps(recorded["description"], sort_keys=True, indent=1))


class Builder:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return {"a": np.arange(1000, dtype=np.int64), "b": np.arange(10, dtype=np.int32) * 3}


@pytest.mark.parametrize("damage,what", [(os.remove, "is missing"), (_truncate, "bytes, "),
                                         (_flip_a_byte, "is damaged (CRC-32 mismatch)"),
                                         (_old_marker, "has no sizes and checksums")])
def test_a_damaged_cache_file_is_rebuilt(tmp_path, capsys, damage, what):
    build = Builder()
    first = {k: np.array(v) for k, v in load_or_build(str(tmp_path), "T", {"k": 1}, build, ("a", "b")).items()}
    again = load_or_build(str(tmp_path), "T", {"k": 1}, build, ("a", "b"))
    assert build.calls == 1  # an intact cache is read, not rebuilt
    victim = glob.glob(str(tmp_path / ("*-description.txt" if damage is _old_marker else "*-a.npy")))[0]
    del again
    damage(victim)
    capsys.readouterr()
    rebuilt = load_or_build(str(tmp_path), "T", {"k": 1}, build, ("a", "b"))
    assert build.calls == 2 and all(np.array_equal(rebuilt[k], first[k]) for k in first)
    assert f"note: index cache file {victim} " in capsys.readouterr().out
    assert load_or_build(str(tmp_path), "T", {"k": 1}, build, ("a", "b")) and build.calls == 2
    assert what


def _dataset(tmp_path):
    rng = np.random.default_rng(0)
    prefix = str(tmp_path / "ids")
    with IndexedDatasetBuilder(prefix, np.int32) as builder:
        for _ in range(60):
            n = int(rng.integers(5, 40))
            builder.add_document(rng.integers(0, 290, size=n), [n])
    return prefix


@pytest.mark.parametrize("damage", [os.remove, _truncate])
def test_a_run_rebuilds_a_damaged_index_file_and_trains_the_same_samples(tmp_path, damage):
    prefix = _dataset(tmp_path)
    cache = tmp_path / "cache"
    argv = [a for a in TINY if a != "--mock-data"] + [
        "--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "299", "--split", "1,0,0",
        "--eval-iters", "0", "--train-iters", "3", "--data-cache-path", str(cache)]
    first = run_ranks(2, main_capturing_stdout, argv)[0][0]["losses"]
    victims = sorted(glob.glob(str(cache / "**" / "*GPTDataset*shuffle*.npy"), recursive=True))
    assert victims, sorted(glob.glob(str(cache / "**"), recursive=True))
    damage(victims[0])
    (history, stdout), (_, other) = run_ranks(2, main_capturing_stdout, argv)
    assert history["losses"] == first
    assert f"note: index cache file {victims[0]} " in stdout + other and "rebuilt it" in stdout + other
    assert os.path.isfile(victims[0])


def _load_from(cache_dirs):
    from mpzero.errors import ConfigError
    from mpzero.parallel import init_parallel

    groups = init_parallel(1)
    try:  # each rank its own directory: what a node-local --data-cache-path is to the other nodes
        load_or_build(cache_dirs[groups.world.rank], "test", {"n": 3}, lambda: {"a": np.arange(3)}, ("a",), groups)
    except ConfigError as error:
        return str(error)
    return None


def test_a_cache_directory_not_shared_by_every_rank_stops_every_rank_with_one_line(tmp_path):
    dirs = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    for d in dirs:
        os.mkdir(d)
    errors = run_ranks(2, _load_from, dirs)
    assert errors[0] == errors[1] and "after rank 0 built it: --data-cache-path must be a directory every rank " \
                                      "can read (a shared file system)" in errors[0], errors
    assert dirs[1] in errors[0]
