"""MFU's denominator: NVIDIA's datasheet dense bf16 peaks by the name CUDA reports (mpzero.training.peak_flops).
The more specific names must win (an H100 PCIe is not an H100 SXM), an unknown GPU has no MFU, and neither has a
CPU run or an fp32 run. On this CPU the training log's line therefore ends at TFLOP/s/rank
(tests/test_pretrain_gpt.py); tests/gpu/test_mixed_precision.py checks the MFU field on a GPU."""

import re

import pytest
import torch

from mpzero.training import DATASHEET_BF16_TFLOPS, datasheet_bf16_tflops
from mpzero.training.peak_flops import mfu_note, mfu_peak
from tests.cli import LINE, TINY, main_capturing_stdout
from tests.distributed import run_ranks


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.4),  # SXM5, as the gpu-check's H100 reported itself
    ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.4),
    ("NVIDIA H200 NVL", 835.0),
    ("NVIDIA GH200 480GB", 989.4),
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0),
    ("Tesla V100-SXM2-32GB", None),  # no bf16 tensor cores
    ("NVIDIA GeForce RTX 4090", None)])
def test_the_datasheet_peak_is_the_most_specific_name_that_matches(name, tflops):
    assert datasheet_bf16_tflops(name) == tflops


def test_each_entry_is_reachable():
    """No entry is shadowed by an earlier, less specific one."""
    for i, (part, tflops) in enumerate(DATASHEET_BF16_TFLOPS):
        assert datasheet_bf16_tflops(f"NVIDIA {part}") == tflops, part
        assert not any(earlier in part for earlier, _ in DATASHEET_BF16_TFLOPS[:i]), part


@pytest.mark.parametrize("device, dtype", [("cpu", "bf16"), ("cpu", "fp32"), ("cuda", "fp32")])
def test_no_mfu_off_a_gpu_or_in_fp32(device, dtype):
    assert mfu_peak(torch.device(device), dtype) is None  # decided before CUDA is asked for a name
    assert mfu_note(None) is None


def test_the_start_line_names_the_peak_or_says_there_is_none():
    assert mfu_note(("NVIDIA H100 80GB HBM3", 989.4)) == (
        "MFU: model FLOPs per second per rank over NVIDIA H100 80GB HBM3's datasheet dense bf16 peak, 989.4 TFLOP/s")
    assert mfu_note(("Tesla V100-SXM2-32GB", None)).startswith(
        "note: no datasheet bf16 peak is known for Tesla V100-SXM2-32GB (mpzero.training.peak_flops)")


def _bf16_run_on_a_rated_device(argv):
    """pretrain_gpt on this CPU with the device's peak as a GPU's would be found (the lookup is tested above): what
    the loop makes of it."""
    import mpzero.training.loop as loop
    import mpzero.training.startup as startup
    loop.mfu_peak = startup.mfu_peak = lambda device, dtype: ("a rated GPU", 1e-4) if dtype == "bf16" else None
    return main_capturing_stdout(argv)


def test_the_log_gives_mfu_as_tflops_per_rank_over_the_peak(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    argv = TINY + ["--bf16", "--train-iters", "3", "--tensorboard-dir", str(tmp_path)]
    _, stdout = run_ranks(1, _bf16_run_on_a_rated_device, argv)[0]
    assert "MFU: model FLOPs per second per rank over a rated GPU's datasheet dense bf16 peak, 0.0001 TFLOP/s" in stdout
    lines = [m.string for m in map(LINE.match, stdout.splitlines()) if m]
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    plotted = [e.value for e in events.Scalars("mfu")]
    assert len(lines) == len(plotted) == 3
    for line, value in zip(lines, plotted):
        tflops, mfu = re.search(r"\| TFLOP/s/rank: ([0-9.]+) \| MFU: ([0-9.]+) \|$", line).groups()
        assert abs(float(mfu) * 1e-4 - float(tflops)) <= 5e-5 + 1e-9, line  # TFLOP/s/rank has 4 decimals
        assert abs(value - float(mfu)) <= 5e-4 * (1 + 1e-6), (value, line)  # the line's MFU has 3
