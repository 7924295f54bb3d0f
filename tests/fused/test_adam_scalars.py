"""AdamW with its scalars in device memory (mpzero/fused/adam_scalars.py), fp16's launched step: bitwise
`adamw_reference` with the row the device picks, nothing written when the skip flag is set, and no read of the
device."""

import pytest
import torch

from mpzero.fused import adamw_reference
from mpzero.fused.adam_scalars import adamw_masked_step, adamw_scalars, pick_row
from tests.host_syncs import counting


@pytest.mark.parametrize("copy_dtype", [None, torch.float16])
@pytest.mark.parametrize("step,weight_decay", [(1, 0.1), (7, 0.0), (1000, 0.1)])
def test_the_masked_step_is_the_references_at_the_picked_row(step, weight_decay, copy_dtype):
    torch.manual_seed(step)
    n, lr, beta1, beta2, eps = 4099, 3e-3 / 7, 0.9, 0.95, 1e-8
    params, grads = torch.randn(n), torch.randn(n).half()
    avg, avg_sq = torch.randn(n) * 0.1, torch.rand(n) * 0.01
    copy = None if copy_dtype is None else torch.empty(n, dtype=copy_dtype)
    mine = [t.clone() for t in (params, avg, avg_sq)] + [None if copy is None else copy.clone()]
    adamw_reference(params, grads, avg, avg_sq, copy, lr, beta1, beta2, eps, weight_decay, step)
    rows = [adamw_scalars(lr * 2, weight_decay, beta1, beta2, step + 1),  # k = 0: no earlier step was skipped
            adamw_scalars(lr, weight_decay, beta1, beta2, step)]  # k = 1: the one this test means
    with counting() as syncs:
        row = pick_row(rows, torch.tensor(1))
        adamw_masked_step(mine[0], grads, mine[1], mine[2], mine[3], row, beta1, beta2, eps, torch.tensor(False))
    assert syncs.events == []
    for want, got in zip((params, avg, avg_sq, copy), mine):
        assert want is None or torch.equal(want, got)
    before = [t.clone() for t in mine[:3]]
    adamw_masked_step(mine[0], torch.full((n,), float("inf")).half(), mine[1], mine[2], mine[3], row, beta1, beta2, eps,
                      torch.tensor(True))
    for want, got in zip(before, mine[:3]):
        assert torch.equal(want, got)
