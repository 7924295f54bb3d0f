"""AdamW with its step-dependent scalars in device memory, for fp16's step launched with no host synchronisation
(issue 46, mpzero/zero/device_scaler.py).

An fp16 overflow skips the update, and a skipped iteration advances neither the learning-rate schedule nor AdamW's
step count. When the step is launched before the host knows whether earlier launched steps were skipped, the host
cannot pick `lr` and `step`; it knows only that k of them were (0 <= k <= the steps launched since it last read). So
it computes every candidate's scalars as `adamw_reference` computes them (Python doubles, `adamw_scalars`), the
device picks row k by its own skip counter (`pick_row`), and `adamw_masked_step` runs the synchronising update's
arithmetic with those values (the reference's ops with 0-dim fp64 tensors, which a kernel rounds to fp32 as it rounds
the floats; the Triton kernel reading the row from memory), writing nothing where the device flag `skip` is set.
torch's fused AdamW takes its learning rate from the host (a tensor one is read on a CPU, rounded to fp32 on CUDA),
so it has no such path.
"""

from __future__ import annotations

import torch

from mpzero.fused.adam import _triton_adamw

ADAMW_MASKED_IMPLS = ("torch", "triton")  # the implementations `adamw_masked_step` repeats bit for bit


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
                      skip: torch.Tensor, impl: str = "torch") -> None:
    """`adamw_step`'s update by `impl` (`ADAMW_MASKED_IMPLS`) with `scalars` = `adamw_scalars(...)` as a device
    tensor; nothing is written where `skip` (a 0-dim bool device tensor) is set. "torch": `adamw_reference` op for op
    (addcdiv's `p + value * m / d` spelled out: its value is a Scalar); "triton": the kernel reads the row (rounded
    to fp32, as the launch rounds the floats) from memory."""
    if impl == "triton":
        in_memory = torch.stack([scalars[0], -scalars[1], scalars[2]]).float()
        _triton_adamw(params, grads, exp_avg, exp_avg_sq, model_copy, 0.0, beta1, beta2, eps, 0.0, 1,
                      torch.ones((), dtype=torch.float32, device=params.device), skip, in_memory)
        return
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
