"""AdamW with its step-dependent scalars in device memory, for fp16's step launched with no host synchronisation
(issue 46, mpzero/zero/device_scaler.py).

An fp16 overflow skips the update, and a skipped iteration advances neither the learning-rate schedule nor AdamW's
step count. When the step is launched before the host knows whether earlier launched steps were skipped, the host
cannot pick `lr` and `step`; it knows only that k of them were (0 <= k <= the steps launched since it last read). So
it computes every candidate's scalars as `adamw_reference` computes them (Python doubles, `adamw_scalars`), the
device picks row k by its own skip counter (`pick_row`), and `adamw_masked_step` runs `adamw_reference`'s
arithmetic with those 0-dim fp64 values (a kernel rounds them to fp32 as it rounds the floats), writing nothing
where the device flag `skip` is set.
"""

from __future__ import annotations

import torch

ADAMW_MASKED_IMPLS = ("torch",)  # the implementations `adamw_masked_step` repeats bit for bit


def adamw_scalars(lr: float, weight_decay: float, beta1: float, beta2: float, step: int) -> tuple[float, ...]:
    """(1 - lr wd, -lr / (1 - beta1^step), sqrt(1 - beta2^step)): `adamw_reference`'s doubles, in its expressions."""
    return 1 - lr * weight_decay, -(lr / (1 - beta1 ** step)), (1 - beta2 ** step) ** 0.5


def pick_row(rows: list[tuple[float, ...]], index: torch.Tensor) -> torch.Tensor:
    """rows[index] as a 1-D fp64 tensor on `index`'s device, with no read of `index` (a gather on the device)."""
    table = torch.tensor(rows, dtype=torch.float64)
    if index.device.type == "cuda":  # pinned, so the copy is queued on the stream and the host does not wait
        table = table.pin_memory().to(index.device, non_blocking=True)
    return table.index_select(0, index.view(1))[0]


def adamw_masked_step(params: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                      model_copy: torch.Tensor | None, scalars: torch.Tensor, beta1: float, beta2: float, eps: float,
                      skip: torch.Tensor) -> None:
    """`adamw_reference` op for op with `scalars` = `adamw_scalars(...)` as a device tensor; nothing is written where
    `skip` (a 0-dim bool device tensor) is set. addcdiv's `p + value * m / d` is spelled out: its value is a Scalar."""
    decay, negative_step_size, bc2_sqrt = scalars[0], scalars[1], scalars[2]
    grads = grads.float()
    new_params = params.mul(decay)
    new_avg = exp_avg.lerp(grads, 1 - beta1)
    new_avg_sq = exp_avg_sq.mul(beta2).addcmul_(grads, grads, value=1 - beta2)
    denom = (new_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    new_params.add_(new_avg.mul(negative_step_size).div_(denom))
    for old, new in ((params, new_params), (exp_avg, new_avg), (exp_avg_sq, new_avg_sq)):
        old.copy_(torch.where(skip, old, new))
    if model_copy is not None:  # a skipped step rewrites the copy from the unchanged masters: the same values
        model_copy.copy_(params)
