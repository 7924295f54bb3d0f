"""fp16 with dynamic loss scaling and bf16, 20 iterations each on the GPU: every loss finite, the loss falls
(the last 5 iterations' mean below the first iteration's), fp16 steps that overflow are skipped; the log's lines
give MFU against the GPU's datasheet peak (or say at start that none is known). And --profile on the GPU:
torch.profiler's trace holds the window's CUDA kernels; Nsight Systems' mode (the CUDA profiler API, NVTX ranges)
runs without nsys attached."""

import json
import math
import re

import pytest
import torch

import pretrain_gpt
from mpzero.training import datasheet_bf16_tflops
from tests.gpu.common import DEVICE, SMALL, needs_cuda

pytestmark = needs_cuda


@pytest.mark.parametrize("precision", [["--fp16", "--initial-loss-scale", "1048576", "--hysteresis", "1"], ["--bf16"]],
                         ids=["fp16-dynamic", "bf16"])
@pytest.mark.parametrize("stage", [1, 3])
def test_twenty_steps_train(precision, stage, capsys):
    history = pretrain_gpt.main(SMALL + precision + ["--train-iters", "20", "--zero-stage", str(stage)])
    out = capsys.readouterr().out
    losses, norms = history["losses"], history["grad_norms"]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses), losses
    applied = [x for x, norm in zip(losses, norms) if norm is not None]
    skipped = len(losses) - len(applied)
    print(f"{precision[0]} stage {stage}: {skipped} skipped (overflow) steps, losses {losses}")
    assert len(applied) >= 10, f"{skipped} of 20 steps skipped: {out[-2000:]}"
    assert sum(losses[-5:]) / 5 < losses[0], losses
    lines = [line for line in out.splitlines() if line.startswith(" iteration ")]
    if DEVICE.type != "cuda":  # MPZERO_GPU_TESTS_ON_CPU: no MFU off a GPU (tests/test_peak_flops.py)
        assert lines and " MFU: " not in out
        return
    peak = datasheet_bf16_tflops(torch.cuda.get_device_name())
    if peak is None:
        assert "note: no datasheet bf16 peak is known for" in out and " MFU: " not in out
    else:
        assert f"datasheet dense bf16 peak, {peak:g} TFLOP/s" in out
        assert len(lines) == 4 and all(re.search(r"\| TFLOP/s/rank: [0-9.]+ \| MFU: \d+\.\d{3} \|$", line)
                                       for line in lines), lines


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA kernels and the CUDA profiler API (tests/test_profile.py "
                                                  "is the CPU's)")
@pytest.mark.parametrize("pytorch", [True, False], ids=["torch.profiler", "nsys"])
def test_profile_traces_the_window(pytorch, tmp_path, capsys):
    flags = ["--profile", "--profile-step-start", "1", "--profile-step-end", "3"]
    flags += ["--use-pytorch-profiler", "--tensorboard-dir", str(tmp_path)] if pytorch else []
    pretrain_gpt.main(SMALL + ["--bf16", "--train-iters", "4"] + flags)
    out = capsys.readouterr().out
    if not pytorch:
        assert "profile: rank 0 traced iterations 2-3 for Nsight Systems" in out
        return
    path = tmp_path / "rank0.iterations-2-3.pt.trace.json"
    assert f"profile: rank 0 traced iterations 2-3 into {path}" in out
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    assert any(event.get("cat") == "kernel" for event in events), "no CUDA kernel in the trace"
