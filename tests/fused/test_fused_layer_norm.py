"""LayerNorm: reference vs F.layer_norm, Triton kernel (fwd + dx, dweight, dbias) vs reference."""

import pytest
import torch
import torch.nn.functional as F

from mpzero.errors import ConfigError
from mpzero.fused import layer_norm, layer_norm_reference
from tests.fused.helpers import DTYPES, needs_triton, tol

# Chosen to break masking: one row of odd width, width 1, a non-power-of-two width over a partial row
# block, a power of two, and a width over 4096 (one row per program, more columns than threads).
SHAPES = [(1, 1, 37), (5, 1), (3, 7, 100), (40, 64), (3, 5000)]


def _inputs(shape, dtype, device):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(device, dtype).requires_grad_()
    w = (torch.randn(shape[-1], generator=g)).to(device).requires_grad_()
    b = (torch.randn(shape[-1], generator=g)).to(device).requires_grad_()
    dy = torch.randn(shape, generator=g).to(device, dtype)
    return x, w, b, dy


def _run(fn, x, w, b, dy):
    x.grad = w.grad = b.grad = None
    y = fn(x, w, b, 1e-5)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad


def test_layer_norm_reference_matches_f_layer_norm():
    x, w, b, dy = _inputs((4, 33), torch.float32, "cpu")
    expected = _run(lambda *a: F.layer_norm(a[0], (33,), *a[1:]), x, w, b, dy)
    for got, want in zip(_run(layer_norm_reference, x, w, b, dy), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # same op on the same fp32 data


def test_layer_norm_reference_keeps_input_dtype_and_fp32_statistics():
    x, w, b, _ = _inputs((4, 33), torch.bfloat16, "cpu")
    y = layer_norm_reference(x, w, b, 1e-5)
    assert y.dtype == torch.bfloat16
    # fp32 statistics: equal to normalising the upcast input, rounded once at the end
    torch.testing.assert_close(y, F.layer_norm(x.float(), (33,), w, b, 1e-5).bfloat16(), rtol=0, atol=0)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_layer_norm_triton_matches_reference(shape, dtype, device):
    x, w, b, dy = _inputs(shape, dtype, device)
    y, dx, dw, db = _run(lambda *a: layer_norm(*a, impl="triton"), x, w, b, dy)
    y_ref, dx_ref, dw_ref, db_ref = _run(layer_norm_reference, x, w, b, dy)
    torch.testing.assert_close(y, y_ref, **tol(dtype))
    torch.testing.assert_close(dx, dx_ref, **tol(dtype))
    # dweight/dbias are fp32 sums over rows taken in another order: fp32 tolerance scaled by the row count.
    rows = x.numel() // shape[-1]
    torch.testing.assert_close(dw, dw_ref, rtol=1e-5, atol=1e-5 * rows)
    torch.testing.assert_close(db, db_ref, rtol=1e-5, atol=1e-5 * rows)


@needs_triton
def test_layer_norm_triton_rejects_rows_wider_than_its_limit(device):
    x, w, b, _ = _inputs((1, 16385), torch.float32, device)
    with pytest.raises(ConfigError, match="exceeds the Triton kernel's limit"):
        layer_norm(x, w, b, impl="triton")


def test_layer_norm_rejects_low_precision_weights():
    x, w, b, _ = _inputs((2, 8), torch.float32, "cpu")
    with pytest.raises(ConfigError, match="weight must be a contiguous fp32 tensor"):
        layer_norm(x, w.half(), b, impl="torch")


@needs_triton
def test_layer_norm_triton_matches_reference_on_empty_input(device):
    # No rows (an empty micro-batch): the backward still launches one program and gives zero dweight/dbias.
    x, w, b, dy = _inputs((0, 3, 8), torch.float32, device)
    for got, want in zip(_run(lambda *a: layer_norm(*a, impl="triton"), x, w, b, dy),
                         _run(layer_norm_reference, x, w, b, dy)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # empty tensors and exact zeros


def test_layer_norm_rejects_parameters_on_another_device():
    x, w, b, _ = _inputs((2, 8), torch.float32, "cpu")
    with pytest.raises(ConfigError, match="bias must be .* on cpu, got torch.float32 \\(8,\\) on meta"):
        layer_norm(x, w, b.to("meta"), impl="torch")
