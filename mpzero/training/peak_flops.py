"""The denominator of MFU as the field reports it: a GPU's dense bf16/fp16 tensor-core peak from NVIDIA's datasheets,
found by the name CUDA reports (torchtitan's convention; nanoGPT's hard-coded A100 figure gave H100 users "104%
MFU", nanoGPT PR #464). The datasheets' headline figures assume 2:4 sparsity and are twice these. A measured matmul
peak is lower (`make gpu-check` measured 736-779 TFLOP/s with [8192, 8192] bf16 matmuls on an H100 SXM rated 989.4),
so gpu-check reports MFU against both; the training log reports it against the datasheet, which other codebases
use too. Only bf16 and fp16 runs have an MFU here: an fp32 run's matmuls run on other units at other peaks."""

from __future__ import annotations

import functools

import torch

# (a part of torch.cuda.get_device_name(), dense bf16 TFLOP/s): the first match counts, so the more specific
# names come first ("NVIDIA H100 PCIe" must not read as the SXM part, "NVIDIA H100 80GB HBM3").
DATASHEET_BF16_TFLOPS = (
    ("H100 NVL", 835.0),  # NVIDIA H100 datasheet: 1,671 with sparsity
    ("H100 PCIe", 756.0),  # 1,513 with sparsity
    ("H100", 989.4),  # H100 SXM: 1,979 with sparsity
    ("H200 NVL", 835.0),  # NVIDIA H200 datasheet: 1,671 with sparsity
    ("H200", 989.4),  # H200 SXM, and GH200 (the same Hopper tensor cores)
    ("A100", 312.0),  # NVIDIA A100 datasheet, SXM and PCIe: 624 with sparsity
)
MFU_DTYPES = ("bf16", "fp16")


def datasheet_bf16_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of the GPU CUDA names `device_name` (TFLOP/s), or None for one not in the table."""
    return next((tflops for part, tflops in DATASHEET_BF16_TFLOPS if part in device_name), None)


@functools.cache  # a run's device and dtype do not change: asked at start and at every log line
def mfu_peak(device: torch.device, dtype: str) -> tuple[str, float | None] | None:
    """(the device's name, its datasheet peak or None if unknown) for a bf16/fp16 run on a CUDA device; None where
    MFU does not apply (another device, fp32)."""
    if device.type != "cuda" or dtype not in MFU_DTYPES:
        return None
    name = torch.cuda.get_device_name(device)
    return name, datasheet_bf16_tflops(name)


def mfu_note(peak: tuple[str, float | None] | None) -> str | None:
    """The start-of-run line saying what the log's MFU is measured against (None where there is no MFU)."""
    if peak is None:
        return None
    name, tflops = peak
    if tflops is None:
        return (f"note: no datasheet bf16 peak is known for {name} (mpzero.training.peak_flops): the log gives "
                f"TFLOP/s/rank and no MFU")
    return f"MFU: model FLOPs per second per rank over {name}'s datasheet dense bf16 peak, {tflops:g} TFLOP/s"
