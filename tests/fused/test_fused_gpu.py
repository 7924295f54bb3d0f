"""Real-GPU checks (skipped without CUDA): the Triton kernels compiled for the GPU, not interpreted, against
their PyTorch references, forward and backward, in fp32/fp16/bf16, at GPT shapes (GPT-2 124M: 8 x 1024
tokens, hidden 768, 12 heads; a 4096-wide GPT) and at edge shapes (one element, width 1, odd widths, the
kernels' widest row, no rows); the chunked cross entropy's compiled arithmetic (--cross-entropy-loss-fusion,
inductor's Triton kernels) against its reference. `make gpu-check` runs this file with the interpreter-sized
tests of tests/fused on the GPU (their `device` fixture is CUDA there)."""

import pytest
import torch

from mpzero.comm import CommGroup
from mpzero.fused import (adamw_step, layer_norm, layer_norm_reference, resolved_impls, scaled_masked_softmax,
                          scaled_masked_softmax_reference)
from mpzero.tensor_parallel import vocab_parallel_linear_cross_entropy
from mpzero.fused.layer_norm import MAX_WIDTH as LN_MAX_WIDTH
from mpzero.fused.softmax import MAX_WIDTH as SOFTMAX_MAX_WIDTH
from tests.fused.helpers import DTYPES, needs_triton, tol

pytestmark = [needs_triton, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# GPT-2 124M activations [b*s, h], a GPT-3-XL-like width, then edges: width 1, odd rows and width, the widest
# row the kernel holds, a single row, no rows.
LN_SHAPES = [(8, 1024, 768), (2, 1024, 4096), (5, 1), (4097, 769), (3, LN_MAX_WIDTH), (1, 37), (0, 768)]
# (scores shape, causal, mask shape or None): the GPT model's call at GPT-2 size (causal, no mask), causal +
# padding mask, a non-causal broadcast mask, sq != sk, one element, the widest row.
SOFTMAX_CASES = [
    ((8, 12, 1024, 1024), True, None),
    ((2, 8, 512, 512), True, (2, 1, 1, 512)),
    ((2, 4, 256, 300), False, (2, 1, 256, 300)),
    ((1, 3, 7, 129), True, None),
    ((1, 1, 1, 1), True, None),
    ((1, 1, 4, SOFTMAX_MAX_WIDTH), True, None),
]
# GPT-2 124M's parameter count (vocab padded to 50304), and edges around the kernel's 1024-element block.
ADAM_SIZES = [124_475_904, 1, 1023, 1025]


def test_auto_on_cuda_is_the_measured_h100_choice():
    # bench/README.md at 5a79686, "On one H100": torch's LayerNorm beats the kernel 2.9x, the Triton softmax and
    # AdamW win; RMSNorm's reference (the activation formula's), the cross entropy compiled 2.9x, the norm's
    # one-pass kernel (mpzero/fused/impl.py)
    assert resolved_impls("cuda") == {"layer_norm": "torch", "rms_norm": "torch", "scaled_masked_softmax": "triton",
                                      "adamw_step": "triton", "cross_entropy": "compile", "sum_of_squares": "triton"}


def _ln_inputs(shape, dtype):
    g = torch.Generator(device="cuda").manual_seed(sum(shape) + 1)
    x = (torch.randn(shape, device="cuda", generator=g) * 2 + 0.5).to(dtype).requires_grad_()
    w = torch.randn(shape[-1], device="cuda", generator=g).requires_grad_()
    b = torch.randn(shape[-1], device="cuda", generator=g).requires_grad_()
    dy = torch.randn(shape, device="cuda", generator=g).to(dtype)
    return x, w, b, dy


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", LN_SHAPES, ids=str)
def test_layer_norm_triton_matches_reference_on_gpu(shape, dtype):
    x, w, b, dy = _ln_inputs(shape, dtype)
    outs = []
    for fn in (lambda: layer_norm(x, w, b, impl="triton"), lambda: layer_norm_reference(x, w, b, 1e-5)):
        x.grad = w.grad = b.grad = None
        y = fn()
        y.backward(dy)
        outs.append((y.detach(), x.grad, w.grad, b.grad))
    (y, dx, dw, db), (y_ref, dx_ref, dw_ref, db_ref) = outs
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == torch.float32
    torch.testing.assert_close(y, y_ref, **tol(dtype))
    # dx = rstd * (w*dy - mean(w*dy) - xhat * mean(xhat*w*dy)): the bracket is a difference of fp32 terms of
    # size |w*dy|, each rounded (and the GPU may fuse w*dy into an FMA on one side only), so its error is a few fp32
    # ulps of |w*dy| times rstd. rstd reaches 1/sqrt(eps) = 316 at width 1 (x - mean = 0): atol scales with it.
    bracket_atol = 0.0
    if x.numel():
        rstd = torch.rsqrt(x.detach().float().var(-1, unbiased=False) + 1e-5)
        wdy = (w.detach() * dy.float()).abs()
        bracket_atol = 4 * torch.finfo(torch.float32).eps * float(wdy.max() * rstd.max())
    dx_tol = tol(dtype, ulps=2)
    torch.testing.assert_close(dx, dx_ref, rtol=dx_tol["rtol"], atol=dx_tol["atol"] + bracket_atol)
    # fp32 sums over up to 8192 rows in another order (per-program partials): relative 1e-4.
    torch.testing.assert_close(dw, dw_ref, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(db, db_ref, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SOFTMAX_CASES, ids=lambda c: f"{c[0]}-causal{c[1]}-mask{c[2]}")
def test_softmax_triton_matches_reference_on_gpu(case, dtype):
    shape, causal, mask_shape = case
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    scores = (torch.randn(shape, device="cuda", generator=g) * 4).to(dtype).requires_grad_()
    mask = None if mask_shape is None else torch.rand(mask_shape, device="cuda", generator=g) < 0.1
    dy = torch.randn(shape, device="cuda", generator=g).to(dtype)
    scale = 0.125
    probs = scaled_masked_softmax(scores, scale, causal, mask, impl="triton")
    (grad,) = torch.autograd.grad(probs, scores, dy)
    probs_ref = scaled_masked_softmax_reference(scores, scale, causal, mask)
    (grad_ref,) = torch.autograd.grad(probs_ref, scores, dy)
    assert probs.dtype == dtype and grad.dtype == dtype
    torch.testing.assert_close(probs, probs_ref, **tol(dtype))
    # see test_fused_softmax: one rounding of the stored probabilities, amplified by |dy|; fp32: 1e-6 for the
    # other summation order of sum(y * dy) over up to 16384 keys.
    atol = max(2 * scale * torch.finfo(dtype).eps * dy.abs().max().item(), 1e-6)
    torch.testing.assert_close(grad, grad_ref, rtol=tol(dtype)["rtol"], atol=atol)


@pytest.mark.parametrize("n", ADAM_SIZES)
@pytest.mark.parametrize("grad_dtype, copy_dtype", [(torch.float32, None), (torch.float32, torch.bfloat16),
                                                    (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16),
                                                    (torch.float16, torch.float16)], ids=str)
def test_adamw_triton_matches_reference_on_gpu(grad_dtype, copy_dtype, n):
    g = torch.Generator(device="cuda").manual_seed(n)
    params = torch.randn(n, device="cuda", generator=g)
    states = [[params.clone(), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")] for _ in range(2)]
    copy = torch.empty(n, dtype=copy_dtype, device="cuda") if copy_dtype is not None else None
    for step in (1, 2, 3):
        grad = torch.randn(n, device="cuda", generator=g).to(grad_dtype)
        for (p, m, v), impl in zip(states, ("triton", "torch")):
            adamw_step(p, grad, m, v, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step,
                       model_copy=copy if impl == "triton" else None, impl=impl)
    for got, want in zip(*states):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)  # FMA contraction: a few ulps
    if copy is not None:
        assert torch.equal(copy, states[0][0].to(copy_dtype))  # the kernel's own p, rounded to nearest even


def test_triton_kernels_follow_the_tensors_device_not_the_current_one():
    """Triton launches on the current CUDA device: the ops make the tensors' device current for the launch."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    x, w, b, dy = (t.detach().to("cuda:1") for t in _ln_inputs((64, 768), torch.bfloat16))
    with torch.cuda.device(0):
        y = layer_norm(x, w, b, impl="triton")
        probs = scaled_masked_softmax(x.view(1, 1, 64, 768).float(), 0.5, False, None, impl="triton")
    torch.testing.assert_close(y, layer_norm_reference(x, w, b, 1e-5), **tol(torch.bfloat16))
    torch.testing.assert_close(probs, scaled_masked_softmax_reference(x.view(1, 1, 64, 768).float(), 0.5, False,
                                                                      None), **tol(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cross_entropy_matches_reference_on_gpu(dtype):
    """4608 tokens in chunks of 2048 (the last, kept, of 512), GPT-2's padded vocabulary (47 padding rows), a loss
    gradient per token. The products are the same calls in both; the compiled passes sum in another order and
    round the gradient to bf16 once from fp32 values ~1e-6 apart: fp32 within 1e-5, bf16 within a few bf16
    roundings of the tensor's largest element."""
    group = CommGroup(None, (0,), 0)  # size 1: every TP collective is the identity
    g = torch.Generator(device="cuda").manual_seed(3)
    x0 = torch.randn(2, 2304, 768, device="cuda", generator=g).to(dtype)
    w0 = (torch.randn(50304, 768, device="cuda", generator=g) * 0.05).to(dtype)
    target = torch.randint(0, 50257, (2, 2304), device="cuda", generator=g)
    grad = torch.rand(2, 2304, device="cuda", generator=g)
    out = {}
    for impl in ("torch", "compile"):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        losses = vocab_parallel_linear_cross_entropy(x, w, target, group, 50257, 2048, impl=impl)
        losses.backward(grad)
        out[impl] = (losses.detach(), x.grad.float(), w.grad.float())
    torch.testing.assert_close(out["compile"][0], out["torch"][0], rtol=1e-5, atol=1e-5)
    for got, want in zip(out["compile"][1:], out["torch"][1:]):
        atol = (1e-5 if dtype == torch.float32 else 2 ** -6) * want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 0, atol=atol)
