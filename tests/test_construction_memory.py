"""Streamed construction's memory, counted and as the operating system sees it.

The `construction peak` on the memory line is the model states plus one bucket's or unit's working set: counted
from the tensors as they are made (meters) and equal to its formula. In a fresh process, the resident high-water
mark (VmHWM) that building a model adds stays under that figure plus the host's working set and a stated
allowance, for a model whose fp32 weights are over 10x one unit; the whole build, which holds the fp32 model,
is above it."""

import json
import os
import subprocess
import sys

import pytest

from tests.cli import ROOT, TINY, main_capturing_stdout
from tests.distributed import run_ranks

ALLOWANCE = 24 * 2 ** 20  # allocator arenas, thread stacks and page-rounding of a fresh process
# glibc raises its mmap threshold each time a large block is freed, after which such blocks come from the heap and
# stay resident when freed: VmHWM would count memory that no tensor holds. Fixed, freed blocks go back at once.
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072"}

BUILD = r"""
import json, sys
import torch
from mpzero.models import GPTConfig, GPTModel
from mpzero.parallel import init_parallel
from mpzero.zero import OffloadConfig, OptimizerConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

streamed, path = sys.argv[1] == "streamed", sys.argv[2]
groups = init_parallel(1)
config = GPTConfig(num_layers=12, hidden_size=512, num_attention_heads=8, vocab_size=1000,
                   max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)
torch.zeros(1) + 1  # torch's lazy initialisation, before the mark
before = hwm()
model = GPTModel(config, groups.tp, device="meta" if streamed else "cpu")
opt = ZeroOptimizer(model, groups, ZeroConfig(stage=3), OptimizerConfig(lr=1e-4),
                    PrecisionConfig("bf16", accumulate_allreduce_grads_in_fp32=False),
                    offload=OffloadConfig(optimizer="disk", params="disk", path=path, sub_group_numel=2 ** 18,
                                          buffer_count=3))
after = hwm()
report = opt.memory_report()
fields = {t.name: t.measured for t in report.tiers + report.construction}
fields.update(numel=opt.numel, unit=max(l.numel for l in opt.stage.layouts[1:]), grown=after - before)
opt.close()
print(json.dumps(fields))
"""


def _build(kind, path):
    out = subprocess.run([sys.executable, "-c", BUILD, kind, str(path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, **MALLOC, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_construction_resident_memory_stays_under_its_formula(tmp_path):
    streamed = _build("streamed", tmp_path / "streamed")
    assert 4 * streamed["numel"] >= 10 * 4 * streamed["unit"]  # the fp32 model is over 10 units
    bound = (streamed["construction peak"] + streamed["construction host working set"] + streamed.get("host", 0)
             + streamed["host buffers"] + ALLOWANCE)  # device states and working set, host states and working set
    assert streamed["grown"] <= bound, (streamed, bound)
    whole = _build("whole", tmp_path / "whole")
    assert whole["grown"] >= streamed["grown"] + 3 * streamed["numel"]  # the whole build holds 4P of fp32 weights


def _construction_fields(argv):
    _, stdout = main_capturing_stdout(argv)
    lines = [line for line in stdout.splitlines() if line.startswith("zero memory")]  # the logging rank's
    return dict(f.strip().rsplit(" ", 1) for f in lines[0].split("|")[1:]) if lines else None


@pytest.mark.parametrize("extra", [["--zero-stage", "1"], ["--zero-stage", "2", "--bf16"],
                                   ["--zero-stage", "3", "--bf16", "--tensor-model-parallel-size", "2"],
                                   ["--zero-stage", "3", "--offload-optimizer", "cpu", "--offload-params", "cpu",
                                    "--bf16"]])
def test_construction_peak_is_counted_and_equals_its_formula(extra):
    fields = run_ranks(4, _construction_fields, TINY + ["--train-iters", "1"] + extra)[0]
    for name in ("construction-peak", "construction-host-working-set"):
        assert int(fields[f"{name} bytes"]) == int(fields[f"{name} formula bytes"]) > 0, fields
    working = int(fields["construction-peak bytes"]) - int(fields["measured bytes"])
    assert working > 0 if "--bf16" in extra else working == 0  # fp32 values are made in the parameters' buffers


def _construction_reports(argv):
    """Every rank's own construction figures (a rank's shard overlaps other parameters than rank 0's)."""
    import torch.distributed as dist
    from mpzero.cli.arguments import parse_args, run_config
    from mpzero.parallel import init_parallel
    from mpzero.training import build_training_state
    import pretrain_gpt
    run = run_config(parse_args(argv), dist.get_world_size())
    state = build_training_state(run, pretrain_gpt.gpt_provider, init_parallel(run.parallel.tensor_model_parallel_size))
    report = state.optimizer.memory_report()
    state.optimizer.close()
    return [(t.name, t.measured, t.formula) for t in report.construction]


def test_every_rank_counts_only_the_parameters_its_shard_overlaps():
    """ZeRO-3 at DP 4: each rank draws the parameters that overlap its own shard, and its formula says the same."""
    # h 64, vocab 100: a layer's MLP weights (16,384 elements) are the largest, and rank 0's quarter of a layer
    # unit holds only its QKV weight (12,288)
    argv = TINY + ["--zero-stage", "3", "--bf16", "--hidden-size", "64", "--vocab-size", "100"]
    per_rank = run_ranks(4, _construction_reports, argv)
    for reports in per_rank:
        for name, measured, formula in reports:
            assert measured == formula, (name, per_rank)
    assert len({reports[1][1] for reports in per_rank}) > 1  # the ranks' host working sets differ
