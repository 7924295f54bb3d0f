"""The global gradient norm over TP and DP ranks, and clipping by it.

norm = sqrt(sum of squared gradient entries of the whole unsharded model). Each rank sums squares
over its own DP slices (DP slices are disjoint and cover every parameter; unpartitioned buffers count
on DP rank 0); TP-sharded parameters (their `TensorPlacement`, see tensor_parallel/placement.py) count on every TP rank,
TP-replicated ones only on TP rank 0 (their gradients are identical on all TP ranks); one all-reduce
over the world adds everything up.
So the printed norm equals the single-process one.

The squares are summed in fp64, run by run in chunks of `CHUNK` elements (an fp64 copy of at most one chunk
exists at a time), and the ranks' partial sums are added as one fp64 scalar. An fp32 sum of millions of
squares is off by ~1e-4 relative, and by a different amount for every way the stages partition it: the
clipping coefficient then differs between layouts and their losses drift apart (issue 12). In fp64 the sum is
exact to ~1e-15 whatever the partition, so every layout clips by the same factor.
"""

from __future__ import annotations

import math

import torch

from mpzero.parallel import ParallelGroups
from mpzero.tensor_parallel.placement import TensorPlacement
from mpzero.zero.flat import FlatLayout


def norm_runs(layouts: list[FlatLayout], placements: dict[str, TensorPlacement], tp_rank: int,
              dp_rank: int) -> list[tuple[int, int, int]]:
    """(bucket, start, end) slices of this rank's gradient shards that count towards the norm."""
    runs = []
    for bucket, layout in enumerate(layouts):
        if layout.parts == 1 and dp_rank != 0:
            continue  # replicated over DP (stage 0): every DP rank holds the same reduced gradients
        for i, start, end in layout.owned_pieces():
            if placements[layout.names[i]].is_sharded or tp_rank == 0:
                runs.append((bucket, start, end))
    return runs


CHUNK = 1 << 22  # elements squared per fp64 pass: a 32 MiB temporary, whatever the bucket size


def sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """sum(x**2) of a 1-D tensor as an fp64 scalar on x's device, accumulated in fp64 chunk by chunk."""
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for start in range(0, x.numel(), CHUNK):
        chunk = x[start:start + CHUNK].to(torch.float64)
        total += torch.dot(chunk, chunk)
    return total


def global_grad_norm(grads: list[torch.Tensor], runs: list[tuple[int, int, int]], groups: ParallelGroups) -> float:
    device = grads[0].device if grads else groups.device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for bucket, start, end in runs:
        total += sum_of_squares(grads[bucket][start:end])
    groups.world.all_reduce(total)  # an fp64 scalar: gloo and NCCL both reduce float64
    return math.sqrt(total.item())


def clip_grads_(grads: list[torch.Tensor], norm: float, max_norm: float) -> None:
    """Megatron's rule: scale by max_norm / (norm + 1e-6) when that is below 1."""
    coef = max_norm / (norm + 1.0e-6)
    if max_norm > 0 and coef < 1.0:
        for grad in grads:
            grad.mul_(coef)


def found_inf(grads: list[torch.Tensor], groups: ParallelGroups) -> bool:
    """True on every rank when any rank's gradients hold an inf or nan (fp16 overflow)."""
    device = grads[0].device if grads else groups.device
    flag = torch.zeros((), dtype=torch.float32, device=device)
    for grad in grads:
        flag = torch.maximum(flag, (~torch.isfinite(grad)).any().float())
    groups.world.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())
