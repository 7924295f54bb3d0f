"""The four tensor-parallel region crossings as autograd functions (Megatron's `mappings.py`).

copy_to     forward identity      backward all-reduce   (replicated input enters a sharded region)
reduce_from forward all-reduce    backward identity     (partial sums leave a sharded region)
scatter_to  forward keep my chunk backward all-gather   (last dimension)
gather_from forward all-gather    backward keep my chunk (last dimension)

Each takes the TP `CommGroup` explicitly; at TP size 1 all four are the identity.
"""

from __future__ import annotations

import torch

from mpzero.comm import CommGroup


def _split_last_dim(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    if x.size(-1) % group.size != 0:
        raise ValueError(f"last dimension {x.size(-1)} is not divisible by the TP size {group.size}")
    return x.chunk(group.size, dim=-1)[group.rank].contiguous()


def _gather_last_dim(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    return group.all_gather_cat(x, dim=-1)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()  # the engine may hand the same buffer to other consumers
        ctx.group.all_reduce(grad)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        group.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    return x if group.size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    return x if group.size == 1 else _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    return x if group.size == 1 else _ScatterToTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    return x if group.size == 1 else _GatherFromTP.apply(x, group)
