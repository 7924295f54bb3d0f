"""The global gradient norm over TP and DP ranks (and the expert grid's), and clipping by it.

norm = sqrt(sum of squared gradient entries of the whole unsharded model). Each rank sums squares
over its own DP slices (DP slices are disjoint and cover every parameter; unpartitioned buffers count
on DP rank 0); TP-sharded parameters (their `TensorPlacement`, see tensor_parallel/placement.py) count on every TP rank,
TP-replicated ones only on TP rank 0 (their gradients are identical on all TP ranks); one all-reduce
over the world adds everything up.
So the printed norm equals the single-process one.

The squares are summed in fp64, run by run (`mpzero.fused.sum_of_squares`: on a CPU in chunks, an fp64 copy of at
most one chunk at a time; on a GPU in one pass that upcasts in registers), and the ranks' partial sums are added as
one fp64 scalar. An fp32 sum of millions of squares is off by ~1e-4 relative, and by a different amount for every
way the stages partition it: the clipping coefficient then differs between layouts and their losses drift apart
(issue 12). In fp64 the sum is exact to ~1e-15 whatever the partition, so every layout clips by the same factor.

Nothing here reads the device: the optimizer reads the squared norm (fp16: with the overflow check folded in)
together with the training loop's own scalars in one copy (`read_to_host`), once per iteration (issue 26).
"""

from __future__ import annotations

import torch

from mpzero.fused import sum_of_squares
from mpzero.parallel import ParallelGroups
from mpzero.tensor_parallel import TensorPlacement, is_pipeline_copy
from mpzero.zero.flat import FlatLayout
from mpzero.zero.step_grads import Fp32Buckets


def norm_runs(layouts: list[FlatLayout], placements: dict[str, TensorPlacement], tp_rank: int,
              dp_rank: int, bucket_ranks: list[tuple[int, int]] | None = None) -> list[tuple[int, int, int]]:
    """(bucket, start, end) slices of this rank's gradient shards that count towards the norm; parameters that lie
    side by side in a bucket make one slice (one fp64 pass, not one per parameter: a GPU launches a few kernels per
    slice). A pipeline stage's copy of a tied parameter counts on the stage that holds the original.
    `bucket_ranks`: per bucket, this rank's place in the TP and DP groups of the bucket's family (zero/families.py:
    an expert bucket counts on expert-TP rank 0 when replicated there, on every EP rank, which holds other experts,
    and on the expert-DP rank that owns the slice, so every expert counts exactly once); default (tp_rank,
    dp_rank) for every bucket."""
    runs = []
    for bucket, layout in enumerate(layouts):
        tp_rank, dp_rank = bucket_ranks[bucket] if bucket_ranks is not None else (tp_rank, dp_rank)
        if layout.parts == 1 and dp_rank != 0:
            continue  # replicated over DP (stage 0): every DP rank holds the same reduced gradients
        for i, start, end in layout.owned_pieces():
            if is_pipeline_copy(layout.params[i]):
                continue
            if placements[layout.names[i]].is_sharded or tp_rank == 0:
                if runs and runs[-1][0] == bucket and runs[-1][2] == start:
                    runs[-1] = (bucket, runs[-1][1], end)
                else:
                    runs.append((bucket, start, end))
    return runs


def grad_norm_squared(grads: list[torch.Tensor], runs: list[tuple[int, int, int]], groups: ParallelGroups,
                      check_overflow: bool = False, scale: float = 1.0) -> torch.Tensor:
    """The squared global norm as an fp64 device scalar, the same on every rank; nothing is read to the host.
    `check_overflow` (fp16): a rank whose gradients hold an inf or nan anywhere (its padding and the copies that
    do not count towards the norm included) contributes inf, so an overflow on any rank makes the sum non-finite
    on every rank: the one all-reduce of the norm is also the overflow check. `scale`: the norm is that of the
    gradients times `scale` (low-precision shards, unscaled chunk by chunk in fp32; see `sum_of_squares`)."""
    device = grads[0].device if grads else groups.device
    sums = [sum_of_squares(grads[bucket][start:end], scale) for bucket, start, end in runs]
    return _reduce(sums, _any_not_finite(grads, device) if check_overflow else None, groups, device)


def _reduce(sums: list[torch.Tensor], not_finite: torch.Tensor | None, groups: ParallelGroups,
            device: torch.device) -> torch.Tensor:
    """The runs' sums added in run order (the same fp64 additions whoever computed them), inf where `not_finite`,
    all-reduced over the world."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for part in sums:
        total += part
    if not_finite is not None:
        total = torch.where(not_finite, torch.inf, total)
    total = total.to(groups.device)  # gradients streamed to host memory: the all-reduce and the read are the device's
    groups.world.all_reduce(total)  # an fp64 scalar: gloo and NCCL both reduce float64
    return total


class ArrivingNorm:
    """The same squared norm for gradients that are not kept where the step could read them (on disk,
    offload/grad_file.py): each bucket's final slice is handed to `add` as it arrives in backward, its runs' sums
    (and the overflow check) taken then; `squared` adds them in run order, the same arithmetic as
    `grad_norm_squared`, once every bucket has arrived."""

    def __init__(self, runs: list[tuple[int, int, int]], buckets: int, check_overflow: bool):
        self.runs, self.buckets, self.check_overflow = runs, buckets, check_overflow
        self._of_bucket: dict[int, list[int]] = {}
        for i, (bucket, _, _) in enumerate(runs):
            self._of_bucket.setdefault(bucket, []).append(i)
        self.reset()

    def reset(self) -> None:
        self._sums: list[torch.Tensor | None] = [None] * len(self.runs)
        self._not_finite: torch.Tensor | None = None
        self._arrived: set[int] = set()

    def add(self, bucket: int, values: torch.Tensor, scale: float) -> None:
        for i in self._of_bucket.get(bucket, ()):
            _, start, end = self.runs[i]
            self._sums[i] = sum_of_squares(values[start:end], scale)
        if self.check_overflow:
            flag = _any_not_finite([values], values.device)
            self._not_finite = flag if self._not_finite is None else self._not_finite | flag
        self._arrived.add(bucket)

    def squared(self, groups: ParallelGroups) -> torch.Tensor:
        missing = sorted(set(range(self.buckets)) - self._arrived)
        if missing:
            raise RuntimeError(f"the gradient norm needs every bucket's final gradients; buckets {missing} did not "
                               "arrive (backward(loss, last_micro_batch=True) reduces them)")
        device = next((part.device for part in self._sums if part is not None), torch.device("cpu"))
        return _reduce(self._sums, self._not_finite, groups, device)  # _not_finite: None without the check


def _any_not_finite(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    flag = torch.zeros((), dtype=torch.bool, device=device)
    for grad in grads:
        flag |= ~torch.isfinite(grad).all()
    return flag


def read_to_host(values: list[torch.Tensor]) -> list[float]:
    """Device scalars as Python floats in one device-to-host copy: the step's one synchronisation."""
    return torch.stack([v.to(torch.float64) for v in values]).tolist()


def clip_coefficient(norm: float, max_norm: float) -> float:
    """Megatron's rule: the gradients are scaled by max_norm / (norm + 1e-6) when that is below 1 (and clipping
    is on, max_norm > 0), else by 1 (a non-finite norm included)."""
    coef = max_norm / (norm + 1.0e-6)
    return coef if max_norm > 0 and coef < 1.0 else 1.0


def clip_coefficient_on_device(squared: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """`clip_coefficient` of the norm sqrt(`squared`) without reading it (issue 46): a 0-dim fp32 device tensor,
    the host's Python double rounded to fp32 as a kernel takes it (the same fp64 sqrt, add and divide, so the same
    value bit for bit); None when clipping is off (every coefficient is 1)."""
    if max_norm <= 0:
        return None
    coef = max_norm / (squared.sqrt() + 1.0e-6)
    return torch.where(coef < 1.0, coef, torch.ones_like(coef)).float()


def scale_grads_(grads: list[torch.Tensor] | Fp32Buckets, coef: float | torch.Tensor) -> None:
    """The gradients times `coef` (a float, or a 0-dim device tensor) in place (`Fp32Buckets`: as each bucket is
    cast); nothing at a float 1."""
    if not isinstance(coef, torch.Tensor) and coef == 1.0:
        return
    if isinstance(grads, Fp32Buckets):
        grads.clip_(coef)
        return
    for grad in grads:
        grad.mul_(coef)
