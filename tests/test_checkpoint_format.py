"""The checkpoint format across versions: a checkpoint written by mpzero before its DCP planners (format 1,
tests/data/format1_tp2_dp2_zero2, made at commit 518ed43) loads and trains on to the loss that code gave,
at its own layout and resharded; the weights read back are the ones that code's consolidated export held;
new checkpoints say their format, write stage 0's DP replicas once, and a newer format is refused.

The fixture was made with (TP 2, DP 2, ZeRO 2, vocabulary 60 padded to 256, so its chunks include TP shards,
partial rows and cropped padding):
    torchrun --nproc_per_node 4 pretrain_gpt.py $FIXTURE_ARGS --tensor-model-parallel-size 2 --zero-stage 2 \\
        --save CKPT --exit-interval 2
and format1_tp2_dp2_zero2.consolidated.pt with that commit's `tools/checkpoint_util.py to-consolidated`."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from mpzero.checkpointing import FORMAT, checkpoint_key, parse_checkpoint_key
from tests.cli import ROOT, TINY, assert_close_lists, exit_code_and_stderr, quiet_main
from tests.distributed import run_ranks

DATA = os.path.join(ROOT, "tests", "data")
FORMAT1 = os.path.join(DATA, "format1_tp2_dp2_zero2")
FIXTURE_ARGS = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
                "--vocab-size", "60", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
                "--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data",
                "--log-interval", "1", "--eval-iters", "0", "--attention-backend", "local"]  # the writing code's auto
# Iteration 3's loss after loading the fixture with the code that wrote it, the same at (TP 2, DP 2, ZeRO 2),
# (TP 1, DP 1) and (TP 1, DP 2, ZeRO 3), and equal to an uninterrupted run's third loss.
NEXT_LOSS = 4.088613510131836


@pytest.fixture
def format1(tmp_path):
    root = tmp_path / "format1"
    shutil.copytree(FORMAT1, root)
    return root


def test_the_fixture_is_format_1():
    with open(os.path.join(FORMAT1, "iter_0000002", "meta.json"), encoding="utf-8") as f:
        assert "format" not in json.load(f)


@pytest.mark.parametrize("world,layout", [(1, []), (4, ["--tensor-model-parallel-size", "2", "--zero-stage", "2"]),
                                          (2, ["--zero-stage", "3"])])
def test_a_format_1_checkpoint_loads_and_trains_on(format1, world, layout):
    history = run_ranks(world, quiet_main, FIXTURE_ARGS + layout + ["--load", str(format1)])[0]
    assert_close_lists(history["losses"], [NEXT_LOSS], rel=1e-6)


def test_a_format_1_checkpoint_exports_the_weights_it_exported_then(format1, tmp_path):
    tool = [sys.executable, os.path.join(ROOT, "tools", "checkpoint_util.py")]
    subprocess.run(tool + ["to-consolidated", "--load", str(format1), "--output", str(tmp_path / "w.pt")], check=True)
    now = torch.load(tmp_path / "w.pt", weights_only=True)["model"]
    then = torch.load(FORMAT1 + ".consolidated.pt", weights_only=True)["model"]
    assert sorted(now) == sorted(then) and all(torch.equal(now[name], then[name]) for name in then)


def _stored_volumes(directory):
    """{key: (elements the stored chunks cover, elements of the tensor)} from DCP's metadata."""
    md = FileSystemReader(directory).read_metadata().state_dict_metadata
    return {key: (sum(math.prod(c.sizes) for c in m.chunks), math.prod(m.size)) for key, m in md.items()}


def test_stage_0_replicas_are_written_once_and_the_format_is_recorded(tmp_path):
    run_ranks(2, quiet_main, TINY + ["--zero-stage", "0", "--train-iters", "1", "--eval-iters", "0",
                                     "--save", str(tmp_path)])
    directory = tmp_path / "iter_0000001"
    volumes = _stored_volumes(str(directory))
    assert volumes and all(covered == total for covered, total in volumes.values()), volumes
    sizes = [os.path.getsize(directory / f"__{r}_0.distcp") for r in range(2)]
    assert min(sizes) > 0.3 * max(sizes), sizes  # DCP's dedup spreads the replicated chunks over both writers
    with open(directory / "meta.json", encoding="utf-8") as f:
        meta = json.load(f)
    assert meta["format"] == FORMAT == 3
    assert set(volumes) == set(meta["shapes"])


def test_a_newer_format_is_refused(format1):
    meta_path = format1 / "iter_0000002" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "format": FORMAT + 1}))
    code, stderr = run_ranks(1, exit_code_and_stderr, FIXTURE_ARGS + ["--load", str(format1)])[0]
    assert code == 2 and f"is in checkpoint format {FORMAT + 1}, newer than this mpzero's ({FORMAT})" in stderr


def test_checkpoint_keys_round_trip():
    assert checkpoint_key("master", "a.weight") == "model/a.weight"
    assert checkpoint_key("exp_avg_sq", "a.weight") == "optimizer/exp_avg_sq/a.weight"
    for state in ("master", "exp_avg", "exp_avg_sq"):
        assert parse_checkpoint_key(checkpoint_key(state, "layers.0.mlp.fc1.bias")) == (state, "layers.0.mlp.fc1.bias")
    for bad in ("model/", "optimizer/exp_avg", "optimizer/momentum/a", "rng/a"):
        with pytest.raises(ValueError):
            parse_checkpoint_key(bad)
    with pytest.raises(ValueError):
        checkpoint_key("momentum", "a")
