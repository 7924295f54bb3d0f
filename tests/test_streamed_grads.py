"""Gradients streamed to the host with an offloaded optimizer (issue 24, item 3): at stages 2-3 each reduced bucket
leaves the device as soon as its reduce-scatter completes (on a CPU run the same code path with host "device"
tensors; only the side stream and pinning are CUDA's). The device-side gradient bytes of backward, counted by
`ShardedGrads.device_meter` as buffers come and go, equal the stated bound `accounting.streamed_grad_bytes`
(2 consecutive buckets + 2 reduced slices with overlap) and stay below the unstreamed path's; stage 3's in-step
peak equals its formula (`Stage3.peak_working_set`, the slices included); and the results (losses, parameters,
masters) are bit for bit those of the in-memory optimizer, with 2 micro-batches (the host accumulates them)."""

import pytest
import torch

from mpzero.parallel import init_parallel
from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer
from mpzero.zero.accounting import step_fp32_bytes, streamed_grad_bytes
from mpzero.zero.config import OffloadConfig
from tests.cli import TINY, main_capturing_stdout
from tests.distributed import run_ranks
from tests.zero_toy import make_batches, make_model

STEPS, MICRO = 3, 2


def _train(stage, dtype, tier, overlap, prefetch, layers, bucket_numel):
    groups = init_parallel(1)
    model = make_model(num_layers=layers)
    precision = PrecisionConfig(dtype, initial_loss_scale=2.0 ** 12)  # fp16: steps that are not skipped
    model.to(precision.torch_dtype)
    zero = ZeroConfig(stage=stage, overlap_comm=overlap, prefetch=prefetch, bucket_numel=bucket_numel)
    offload = OffloadConfig(optimizer=tier, sub_group_numel=301)
    opt = ZeroOptimizer(model, groups, zero, AdamConfig(lr=1e-2, impl="torch"), precision, offload=offload)
    losses = []
    for step_batches in make_batches(STEPS, MICRO, groups.dp_size):
        total = 0.0
        for m, micro in enumerate(step_batches):
            loss = model(*micro[groups.dp_rank]).mean() / MICRO
            opt.backward(loss, last_micro_batch=m == MICRO - 1)
            total += loss.item()
        losses.append((total, opt.step().grad_norm))
    grads, report = opt.stage.grads, opt.memory_report()
    g = precision.grad_dtype.itemsize
    layouts = opt.stage.layouts
    full, shard = [l.padded_numel for l in layouts], [l.shard_numel for l in layouts]
    if stage == 3:  # the root (unit 0) opens backward and completes last; layers come in reverse
        bound = streamed_grad_bytes(full, shard, g, overlap, grads.streamed, order=list(range(len(full) - 1, 0, -1)),
                                    held_open=(0,))[0]
    else:
        bound = streamed_grad_bytes(full, shard, g, overlap, grads.streamed)[0]
    persistent = 0 if grads.streamed else g * sum(shard)
    params = model.parameters() if stage < 3 else opt.stage.param_shards  # stage 3: released between uses
    result = dict(losses=losses, params=[p.detach().clone() for p in params],
                  masters=[m.clone() for m in opt.masters.masters()], streamed=grads.streamed,
                  device_peak=grads.device_meter.peak, bound=bound + persistent, report=report,
                  host=[t.measured for t in report.tiers if t.name == "host"], fp32_peak=opt.step_fp32_peak,
                  fp32_bound=step_fp32_bytes(tier != "none", max(shard), offload.sub_group_numel)[0] if g < 4 else 0)
    opt.close()
    return result


CASES = [  # stage, dtype, overlap, prefetch, layers, bucket_numel
    (2, "fp32", True, True, 2, 300), (2, "bf16", True, True, 3, 200), (2, "fp16", True, True, 3, 10 ** 6),
    (2, "fp32", False, True, 2, 300), (3, "fp32", True, True, 4, 0), (3, "bf16", True, False, 3, 0),
    (3, "fp16", False, True, 3, 0), (3, "bf16", True, True, 2, 0),
]


@pytest.mark.parametrize("stage,dtype,overlap,prefetch,layers,bucket_numel", CASES)
@pytest.mark.parametrize("dp", [1, 2])
def test_streamed_gradients_are_bounded_and_bitwise_the_in_memory_run(stage, dtype, overlap, prefetch, layers,
                                                                        bucket_numel, dp):
    bucket_numel = bucket_numel or 10 ** 6
    args = (stage, dtype, overlap, prefetch, layers, bucket_numel)
    for streamed, in_memory in zip(run_ranks(dp, _train, stage, dtype, "cpu", *args[2:]),
                                   run_ranks(dp, _train, stage, dtype, "none", *args[2:])):
        assert streamed["streamed"] and not in_memory["streamed"]
        assert streamed["losses"] == in_memory["losses"] and all(norm for _, norm in streamed["losses"])
        assert all(torch.equal(a, b) for a, b in zip(streamed["params"], in_memory["params"]))
        assert all(torch.equal(a, b) for a, b in zip(streamed["masters"], in_memory["masters"]))
        # the device's gradient bytes: exactly the stated bound, and less than keeping the partition there
        assert streamed["device_peak"] == streamed["bound"], (streamed["device_peak"], streamed["bound"])
        assert in_memory["device_peak"] == in_memory["bound"]
        assert streamed["device_peak"] <= in_memory["device_peak"]  # one bucket at DP 1: a slice for the shard
        # fp16's gradients: the step's fp32 copies, a bucket at a time in memory, two sub-groups at most offloaded
        assert streamed["fp32_peak"] <= streamed["fp32_bound"] and in_memory["fp32_peak"] == in_memory["fp32_bound"]
        report = streamed["report"]
        if report.peak is not None:  # stage 3: the meter at its fullest = the shards + the stated working set
            assert report.peak.measured - report.measured == report.peak.formula - report.formula, report.line()


@pytest.mark.parametrize("stage,extra", [(2, []), (3, ["--offload-params", "cpu"])])
def test_the_memory_line_prints_the_streamed_peak_against_its_formula(stage, extra):
    """Through pretrain_gpt at DP 2: the line printed after the first step carries the in-step peak (shards + the
    gradient buckets and slices in flight; stage 3 also the units gathered), counted = formula; the gradient
    partition is host state (g = 4: bf16 with fp32 gradients), the device holds none of it between steps."""
    argv = TINY + ["--bf16", "--zero-stage", str(stage), "--offload-optimizer", "cpu", "--zero-bucket-numel", "3000",
                   "--train-iters", "2", "--eval-iters", "0"] + extra
    _, stdout = run_ranks(2, main_capturing_stdout, argv)[0]
    lines = [dict(f.strip().rsplit(" ", 1) for f in line.split("|")[1:])
             for line in stdout.splitlines() if line.startswith("zero memory")]
    memory = lines[-1]
    assert len(lines) == 2 and "peak bytes" in memory, stdout
    assert memory["formula"] == ("2P" if stage == 2 else "0") and memory["host formula"] == \
        ("16P/N" if stage == 2 else "18P/N"), memory
    assert int(memory["peak bytes"]) - int(memory["measured bytes"]) == \
        int(memory["peak formula bytes"]) - int(memory["formula bytes"]), memory
    # stage 2: two buckets and two slices (g = 4); stage 3 with everything offloaded: only the working set, the
    # streamed slices (S<k>: unit k's shard) in it
    assert memory["peak formula"] == "2P+4x(2B+2S)" if stage == 2 else "+S" in memory["peak formula"], memory
