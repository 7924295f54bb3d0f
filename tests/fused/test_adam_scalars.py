"""AdamW with its scalars in device memory (mpzero/fused/adam_scalars.py), fp16's launched step: bitwise the
synchronising `adamw_step` of the same implementation (the reference, the Triton kernel) at the row the device picks,
nothing written when the skip flag is set, and no read of the device."""

import pytest
import torch

from mpzero.fused import adamw_masked_step, adamw_scalars, adamw_step, pick_row
from tests.fused.helpers import needs_triton
from tests.host_syncs import counting

IMPLS = ["torch", pytest.param("triton", marks=needs_triton)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("copy_dtype", [None, torch.float16])
@pytest.mark.parametrize("step,weight_decay", [(1, 0.1), (7, 0.0), (1000, 0.1)])
def test_the_masked_step_is_the_synchronising_one_at_the_picked_row(device, impl, step, weight_decay, copy_dtype):
    torch.manual_seed(step)
    n, lr, beta1, beta2, eps = 4099, 3e-3 / 7, 0.9, 0.95, 1e-8
    params, grads = torch.randn(n, device=device), torch.randn(n, device=device)
    avg, avg_sq = torch.randn(n, device=device) * 0.1, torch.rand(n, device=device) * 0.01
    copy = None if copy_dtype is None else torch.empty(n, dtype=copy_dtype, device=device)
    mine = [t.clone() for t in (params, avg, avg_sq)] + [None if copy is None else copy.clone()]
    adamw_step(params, grads, avg, avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
               step=step, model_copy=copy, impl=impl)
    rows = [adamw_scalars(lr * 2, weight_decay, beta1, beta2, step + 1),  # k = 0: no earlier step was skipped
            adamw_scalars(lr, weight_decay, beta1, beta2, step)]  # k = 1: the one this test means
    with counting() as syncs:
        row = pick_row(rows, torch.tensor(1, device=device))
        adamw_masked_step(mine[0], grads, mine[1], mine[2], mine[3], row, beta1, beta2, eps,
                          torch.tensor(False, device=device), impl)
    assert syncs.events == []
    for want, got in zip((params, avg, avg_sq, copy), mine):
        assert want is None or torch.equal(want, got)
    before = [t.clone() for t in mine[:3]]
    adamw_masked_step(mine[0], torch.full((n,), float("inf"), device=device), mine[1], mine[2], mine[3], row, beta1,
                      beta2, eps, torch.tensor(True, device=device), impl)
    for want, got in zip(before, mine[:3]):
        assert torch.equal(want, got)
