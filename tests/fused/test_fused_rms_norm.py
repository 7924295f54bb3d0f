"""RMSNorm: the reference against the formula written here, the Triton kernel (fwd + dx, dweight) against the
reference, on shapes chosen to break masking."""

import pytest
import torch

from mpzero.errors import ConfigError
from mpzero.fused import rms_norm, rms_norm_reference
from tests.fused.helpers import DTYPES, needs_triton, tol

# One row of odd width, width 1, a non-power-of-two width over a partial row block, a power of two, and a width
# over 4096 (one row per program, more columns than threads).
SHAPES = [(1, 1, 37), (5, 1), (3, 7, 100), (40, 64), (3, 5000)]


def _inputs(shape, dtype, device):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(device, dtype).requires_grad_()
    w = torch.randn(shape[-1], generator=g).to(device).requires_grad_()
    dy = torch.randn(shape, generator=g).to(device, dtype)
    return x, w, dy


def _run(fn, x, w, dy):
    x.grad = w.grad = None
    y = fn(x, w, 1e-6)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def _formula(x, w, eps):
    """y_i = x_i / sqrt(sum_j x_j^2 / n + eps) * w_i, in float64 (the independent reference)."""
    x64 = x.double()
    return (x64 / torch.sqrt((x64 * x64).sum(-1, keepdim=True) / x.shape[-1] + eps) * w.double()).float()


def test_rms_norm_reference_matches_the_formula():
    x, w, dy = _inputs((4, 33), torch.float32, "cpu")
    got = _run(rms_norm_reference, x, w, dy)
    want = _run(_formula, x, w, dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # fp32 against float64: rounding only


def test_rms_norm_reference_keeps_input_dtype_and_fp32_statistics():
    x, w, _ = _inputs((4, 33), torch.bfloat16, "cpu")
    y = rms_norm_reference(x, w, 1e-6)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, _formula(x.float(), w, 1e-6).bfloat16(), rtol=0, atol=0)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm_triton_matches_reference(shape, dtype, device):
    x, w, dy = _inputs(shape, dtype, device)
    y, dx, dw = _run(lambda *a: rms_norm(*a, impl="triton"), x, w, dy)
    y_ref, dx_ref, dw_ref = _run(rms_norm_reference, x, w, dy)
    torch.testing.assert_close(y, y_ref, **tol(dtype))
    torch.testing.assert_close(dx, dx_ref, **tol(dtype))
    # dweight is an fp32 sum over rows taken in another order: fp32 tolerance scaled by the row count.
    rows = x.numel() // shape[-1]
    torch.testing.assert_close(dw, dw_ref, rtol=1e-5, atol=1e-5 * rows)


@needs_triton
def test_rms_norm_triton_matches_reference_on_empty_input(device):
    x, w, dy = _inputs((0, 3, 8), torch.float32, device)
    for got, want in zip(_run(lambda *a: rms_norm(*a, impl="triton"), x, w, dy), _run(rms_norm_reference, x, w, dy)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_rms_norm_rejects_low_precision_weights():
    x, w, _ = _inputs((2, 8), torch.float32, "cpu")
    with pytest.raises(ConfigError, match="weight must be a contiguous fp32 tensor"):
        rms_norm(x, w.half(), impl="torch")
