"""Scaled masked softmax: reference semantics, Triton kernel (fwd + bwd) vs reference, Megatron's gate."""

import pytest
import torch

from mpzero.errors import ConfigError
from mpzero.fused import fused_softmax_supported, scaled_masked_softmax, scaled_masked_softmax_reference
from mpzero.fused.softmax import _megatron_batch_per_block
from tests.fused.helpers import DTYPES, needs_triton, tol

# (scores shape, causal, mask shape or None, fully excluded query rows). Chosen to break masking: one
# element, odd and non-power-of-two widths, sq != sk, masks broadcast over batch/heads/queries, fully
# excluded rows (by the mask alone and by mask + causal).
CASES = [
    ((1, 1, 1, 1), True, None, ()),
    ((2, 3, 5, 5), True, None, ()),
    ((1, 2, 3, 7), True, None, ()),
    ((1, 2, 3, 37), False, (1, 1, 3, 37), (1,)),
    ((2, 1, 6, 6), True, (2, 1, 6, 6), (0, 4)),
    ((1, 2, 4, 300), False, (1, 1, 1, 300), ()),
    ((2, 2, 3, 9), False, (2, 2, 3, 9), (2,)),
]


def _inputs(case, dtype, device):
    shape, causal, mask_shape, empty_rows = case
    g = torch.Generator().manual_seed(sum(shape))
    scores = (torch.randn(shape, generator=g) * 4).to(device, dtype).requires_grad_()
    mask = None
    if mask_shape is not None:
        mask = torch.rand(mask_shape, generator=g) < 0.3
        mask[..., list(empty_rows), :] = True
        mask = mask.to(device)
    return scores, causal, mask, torch.randn(shape, generator=g).to(device, dtype)


def _run(fn, scores, causal, mask, dy):
    scores.grad = None
    probs = fn(scores, 0.7, causal, mask)
    probs.backward(dy)
    return probs.detach(), scores.grad


def test_softmax_reference_matches_torch_softmax_and_zeroes_empty_rows():
    scores, causal, mask, dy = _inputs(CASES[4], torch.float32, "cpu")
    probs, grad = _run(scaled_masked_softmax_reference, scores, causal, mask, dy)
    assert not probs.isnan().any() and not grad.isnan().any()
    # Fully excluded rows (queries 0 and 4): zero probabilities, zero gradient.
    assert probs[..., [0, 4], :].eq(0).all() and grad[..., [0, 4], :].eq(0).all()
    # Other rows: plain softmax with -inf at the excluded keys, the same fp32 ops.
    excluded = mask | torch.ones(6, 6, dtype=torch.bool).triu(1)
    expected = torch.softmax((0.7 * scores).masked_fill(excluded, float("-inf")), dim=-1).detach()
    rows = [1, 2, 3, 5]
    torch.testing.assert_close(probs[..., rows, :], expected[..., rows, :], rtol=0, atol=0)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-causal{c[1]}-mask{c[2]}")
def test_softmax_triton_matches_reference(case, dtype, device):
    scores, causal, mask, dy = _inputs(case, dtype, device)
    probs, grad = _run(lambda *a: scaled_masked_softmax(*a, impl="triton"), scores, causal, mask, dy)
    probs_ref, grad_ref = _run(scaled_masked_softmax_reference, scores, causal, mask, dy)
    torch.testing.assert_close(probs, probs_ref, **tol(dtype))
    # dx = scale * p * (dy - sum(p * dy)). The kernel's backward reads the probabilities it stored
    # (rounded to dtype, as Megatron's kernel does), the reference's autograd its fp32 ones: one rounding
    # of p moves dx by up to ~2 * scale * eps * max|dy| in absolute terms (cancellation in dy - sum).
    eps = torch.finfo(dtype).eps if dtype != torch.float32 else 1e-6
    torch.testing.assert_close(grad, grad_ref, rtol=tol(dtype)["rtol"], atol=2 * 0.7 * eps * dy.abs().max().item())
    for row in case[3]:
        assert probs[..., row, :].eq(0).all() and grad[..., row, :].eq(0).all()


def test_softmax_rejects_a_mask_that_does_not_broadcast():
    scores = torch.zeros(2, 2, 4, 4)
    with pytest.raises(ConfigError, match="does not broadcast"):
        scaled_masked_softmax(scores, 1.0, False, torch.zeros(3, 1, 4, 4, dtype=torch.bool), impl="torch")
    with pytest.raises(ConfigError, match="4-D bool tensor"):
        scaled_masked_softmax(scores, 1.0, False, torch.zeros(2, 1, 4, 4), impl="torch")


@pytest.mark.parametrize("sk, expected", [(17, 8), (32, 8), (33, 8), (128, 8), (129, 4), (1024, 4), (4096, 4)])
def test_megatron_batch_per_block_matches_its_cuda_formula(sk, expected):
    # 128-thread blocks; one warp (32 threads) per row at sk > 128, two rows per warp at sk <= 128.
    assert _megatron_batch_per_block(sk) == expected


# (b, heads, sq, sk, dtype, causal) -> whether Megatron's FusedScaleMaskSoftmax takes the fused path.
GATE = [
    ((2, 8, 1024, 1024, torch.float16, True), True),    # GPT training shape
    ((2, 8, 1024, 1024, torch.bfloat16, True), True),
    ((2, 8, 1024, 1024, torch.float32, True), False),   # fp32 input is never fused
    ((2, 8, 16, 16, torch.float16, True), False),       # sk must be > 16
    ((2, 8, 4096, 4096, torch.float16, True), True),    # sk <= 4096 ...
    ((2, 8, 4100, 4100, torch.float16, True), False),   # ... and not beyond
    ((2, 8, 1022, 1022, torch.float16, True), False),   # sq, sk multiples of 4
    ((1, 2, 64, 64, torch.float16, True), False),       # b * heads a multiple of 4
    ((1, 4, 64, 64, torch.float16, True), False),       # causal: b * heads (4) % batch_per_block (8)
    ((1, 8, 64, 64, torch.float16, True), True),
    ((1, 8, 32, 64, torch.float16, True), False),       # causal kernel needs sq == sk
    ((1, 4, 12, 64, torch.float16, False), False),      # masked: sq (12) % batch_per_block (8)
    ((1, 4, 16, 64, torch.float16, False), True),
    ((1, 4, 20, 256, torch.bfloat16, False), True),     # sk > 128: batch_per_block 4
]


@pytest.mark.parametrize("args, expected", GATE, ids=lambda v: str(v))
def test_fused_softmax_supported_matches_megatron_gate(args, expected):
    assert fused_softmax_supported(*args) is expected
