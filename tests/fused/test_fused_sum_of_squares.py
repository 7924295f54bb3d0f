"""The global norm's sum of squares in fp64: the reference against an exact sum, the kernel against the reference."""

import math

import pytest
import torch

from mpzero.fused import sum_of_squares, sum_of_squares_bytes, sum_of_squares_reference
from mpzero.fused.squares import BLOCK, CHUNK, CPU_CHUNK
from tests.fused.helpers import DTYPES, needs_triton


def _exact(x: torch.Tensor, scale: float) -> float:
    """The true sum of the squares the norm means: each element cast to fp32, times scale in fp32, squared
    exactly (fp64 holds an fp32 square), summed without rounding (math.fsum)."""
    values = x.float() * scale if scale != 1.0 else x.float()
    return math.fsum(v * v for v in values.double().tolist())


def _gradients(n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    return (torch.randn(n, generator=g) * torch.logspace(-4, 2, n)).to(dtype)  # six decades of magnitude


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [1.0, 2.0 ** -13], ids=["unscaled", "loss-scaled"])
def test_the_reference_is_the_exact_sum_to_fp64_rounding(dtype, scale, monkeypatch):
    monkeypatch.setattr("mpzero.fused.squares.CPU_CHUNK", 1000)  # several chunks, the last partial
    x = _gradients(3 * 1000 + 17, dtype)
    assert sum_of_squares_reference(x, scale).item() == pytest.approx(_exact(x, scale), rel=1e-14)


def _chunk_by_chunk(x: torch.Tensor, chunk: int, scale: float) -> torch.Tensor:
    """The reference's arithmetic with a fresh fp64 copy of each chunk, as it was before it reused one buffer."""
    total = torch.zeros((), dtype=torch.float64)
    for part in x.split(chunk):
        part = part.to(torch.float32, copy=True).mul_(scale) if scale != 1.0 else part
        part = part.to(torch.float64)
        total += torch.dot(part, part)
    return total


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [1.0, 2.0 ** -13], ids=["unscaled", "loss-scaled"])
def test_one_reused_buffer_gives_the_bits_of_a_fresh_copy_per_chunk(dtype, scale):
    x = _gradients(2 * CPU_CHUNK + 17, dtype)
    assert torch.equal(sum_of_squares_reference(x, scale), _chunk_by_chunk(x, CPU_CHUNK, scale))
    run = x[:CPU_CHUNK]  # a run of at most one chunk: one fp64 dot product, the same bits at any chunk size
    assert torch.equal(sum_of_squares_reference(run, scale), _chunk_by_chunk(run, CHUNK, scale))


def test_the_working_bytes_the_planner_reads():
    # the reference: one fp64 chunk (+ its fp32 unscaled copy) of at most 256K elements on a CPU, 4M on a GPU;
    # the kernel: its partial sums
    assert (CPU_CHUNK, CHUNK) == (1 << 18, 1 << 22)
    assert sum_of_squares_bytes(10 * CHUNK, "torch", scaled=False, device="cpu") == 8 * CPU_CHUNK
    assert sum_of_squares_bytes(10 * CHUNK, "torch", scaled=False, device="cuda") == 8 * CHUNK
    assert sum_of_squares_bytes(1000, "torch", scaled=True, device="cpu") == 12 * 1000
    assert sum_of_squares_bytes(124_475_904, "triton", scaled=True) == 8 * 30390  # ceil(124475904 / 4096)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [1.0, 2.0 ** -13], ids=["unscaled", "loss-scaled"])
@pytest.mark.parametrize("n", [0, 1, BLOCK - 1, 2 * BLOCK + 5], ids=lambda n: f"n{n}")
def test_the_kernel_equals_the_reference_to_fp64_rounding(device, dtype, scale, n):
    x = _gradients(n, dtype).to(device)
    got = sum_of_squares(x, scale, impl="triton")
    assert got.dtype == torch.float64 and got.shape == () and got.device == x.device
    assert got.item() == pytest.approx(sum_of_squares_reference(x, scale).item(), rel=1e-14, abs=0.0)


@needs_triton
def test_the_kernel_is_deterministic(device):
    x = _gradients(3 * BLOCK, torch.float32).to(device)
    assert torch.equal(sum_of_squares(x, impl="triton"), sum_of_squares(x, impl="triton"))


def test_a_tensor_that_is_not_flat_is_refused():
    with pytest.raises(ValueError, match="contiguous 1-D"):
        sum_of_squares(torch.ones(4, 4))
    with pytest.raises(ValueError, match="contiguous 1-D"):
        sum_of_squares(torch.ones(8)[::2])


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_scale_on_the_device_gives_the_bits_of_the_float(device, impl, dtype):
    """fp16's launched step unscales by 1 / its device loss scale (issue 46), an fp64 tensor never read."""
    x, scale = _gradients(2 * BLOCK + 5, dtype).to(device), 1.0 / (2.0 ** 13 * 3)
    on_device = torch.full((), scale, dtype=torch.float64, device=device)
    assert torch.equal(sum_of_squares(x, on_device, impl=impl), sum_of_squares(x, scale, impl=impl))
