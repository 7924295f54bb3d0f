"""Real-GPU checks at training sizes (skipped without CUDA): the Triton kernels, not interpreted."""

import pytest
import torch

from mpzero.fused import (adamw_step, layer_norm, layer_norm_reference, resolved_impls, scaled_masked_softmax,
                          scaled_masked_softmax_reference)
from tests.fused.helpers import needs_triton, tol

pytestmark = [needs_triton, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_auto_picks_triton_on_cuda():
    assert set(resolved_impls("cuda").values()) == {"triton"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_layer_norm_triton_matches_reference_on_gpu(dtype):
    x = torch.randn(8, 512, 1000, device="cuda").to(dtype).requires_grad_()
    w = torch.randn(1000, device="cuda", requires_grad=True)
    b = torch.randn(1000, device="cuda", requires_grad=True)
    dy = torch.randn_like(x)
    outs = []
    for fn in (lambda: layer_norm(x, w, b, impl="triton"), lambda: layer_norm_reference(x, w, b, 1e-5)):
        x.grad = w.grad = b.grad = None
        y = fn()
        y.backward(dy)
        outs.append((y.detach(), x.grad, w.grad, b.grad))
    (y, dx, dw, db), (y_ref, dx_ref, dw_ref, db_ref) = outs
    torch.testing.assert_close(y, y_ref, **tol(dtype))
    torch.testing.assert_close(dx, dx_ref, **tol(dtype, ulps=2))
    # fp32 sums over 4096 rows in another order (per-program partials): relative 1e-4.
    torch.testing.assert_close(dw, dw_ref, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(db, db_ref, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_softmax_triton_matches_reference_on_gpu(dtype):
    scores = torch.randn(2, 8, 1024, 1024, device="cuda").to(dtype).requires_grad_()
    mask = torch.rand(2, 1, 1, 1024, device="cuda") < 0.1
    dy = torch.randn_like(scores)
    probs = scaled_masked_softmax(scores, 0.125, True, mask, impl="triton")
    (grad,) = torch.autograd.grad(probs, scores, dy)
    probs_ref = scaled_masked_softmax_reference(scores, 0.125, True, mask)
    (grad_ref,) = torch.autograd.grad(probs_ref, scores, dy)
    torch.testing.assert_close(probs, probs_ref, **tol(dtype))
    # see test_fused_softmax: one rounding of the stored probabilities, amplified by |dy|
    atol = 2 * 0.125 * torch.finfo(dtype).eps * dy.abs().max().item()
    torch.testing.assert_close(grad, grad_ref, rtol=tol(dtype)["rtol"], atol=atol)


def test_adamw_triton_matches_reference_on_gpu():
    n = (1 << 24) + 3
    params = torch.randn(n, device="cuda")
    states = [[params.clone(), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")] for _ in range(2)]
    copy = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    for step in (1, 2, 3):
        grad = torch.randn(n, device="cuda").bfloat16()
        for (p, m, v), impl in zip(states, ("triton", "torch")):
            adamw_step(p, grad, m, v, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step,
                       model_copy=copy if impl == "triton" else None, impl=impl)
    for got, want in zip(*states):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)  # FMA contraction: a few ulps
    assert torch.equal(copy, states[0][0].bfloat16())  # round-to-nearest-even, as torch's cast
