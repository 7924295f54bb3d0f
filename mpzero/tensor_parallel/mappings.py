"""The four tensor-parallel region crossings as autograd functions (Megatron's `mappings.py`).

copy_to     forward identity      backward all-reduce   (replicated input enters a sharded region)
reduce_from forward all-reduce    backward identity     (partial sums leave a sharded region)
scatter_to  forward keep my chunk backward all-gather   (last dimension)
gather_from forward all-gather    backward keep my chunk (last dimension)

Sequence parallelism (Megatron's SP, Korthikanti et al. 2022) adds crossings along the sequence dimension
(dimension 1 of mpzero's [batch, seq, hidden] activations):

scatter_to_sequence_parallel        forward keep my sequence chunk   backward all-gather
reduce_scatter_to_sequence_parallel forward reduce-scatter           backward all-gather
gather_from_sequence_parallel       forward all-gather               backward reduce-scatter

Each takes the TP `CommGroup` explicitly; at TP size 1 all are the identity.
"""

from __future__ import annotations

import torch

from mpzero.comm import CommGroup


def _split_last_dim(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    if x.size(-1) % group.size != 0:
        raise ValueError(f"last dimension {x.size(-1)} is not divisible by the TP size {group.size}")
    return _own_copy(x.chunk(group.size, dim=-1)[group.rank])


def _own_copy(piece: torch.Tensor) -> torch.Tensor:
    """A split's piece in storage of its own. `.contiguous()` would return a piece that is already contiguous (the
    sequence chunk of a micro-batch of one) as a view that keeps the whole tensor alive: at SP, the first layer would
    hold every rank's embedding output as long as it keeps its input (Megatron clones its scatter's output for the
    same reason: clone_scatter_output_in_embedding)."""
    return piece.clone(memory_format=torch.contiguous_format)


def _gather_last_dim(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    return group.all_gather_cat(x, dim=-1)


def split_sequence(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """This rank's contiguous chunk of the sequence (dimension 1)."""
    if x.size(1) % group.size != 0:
        raise ValueError(f"sequence length {x.size(1)} is not divisible by the TP size {group.size}")
    return _own_copy(x.chunk(group.size, dim=1)[group.rank])


def gather_sequence(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Every rank's sequence chunk, concatenated in rank order along dimension 1."""
    return group.all_gather_cat(x, dim=1)


def reduce_scatter_sequence(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """The sum over the group of x [b, s, ...], this rank keeping sequence chunk r: [b, s/t, ...]."""
    b, s = x.shape[:2]
    if s % group.size != 0:
        raise ValueError(f"sequence length {s} is not divisible by the TP size {group.size}")
    chunks = x.reshape(b, group.size, s // group.size, *x.shape[2:]).transpose(0, 1).contiguous()
    out = torch.empty((b, s // group.size) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
    group.reduce_scatter_into(out.view(-1), chunks.view(-1))
    return out


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


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_sequence(grad, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_sequence(grad, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sequence(grad, ctx.group), None


def scatter_to_sequence_parallel(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    return x if group.size == 1 else _ScatterToSequence.apply(x, group)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    return x if group.size == 1 else _ReduceScatterToSequence.apply(x, group)


def gather_from_sequence_parallel(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    return x if group.size == 1 else _GatherFromSequence.apply(x, group)


def copy_to_tp(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    return x if group.size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    return x if group.size == 1 else _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    return x if group.size == 1 else _ScatterToTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    return x if group.size == 1 else _GatherFromTP.apply(x, group)
