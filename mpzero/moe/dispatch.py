"""Token dispatchers (Megatron's --moe-token-dispatcher-type): how each token reaches the experts it was routed to
on other expert-parallel ranks and how their outputs come back, weighted by the gates.

`alltoall` (MoEAlltoAllTokenDispatcher): the (token, slot) pairs are sorted by expert, each rank's count per
expert is exchanged (an all-to-all of [EP, E_l] integers), the rows go to the ranks holding their experts by one
`all_to_all_single` with uneven splits, are reordered there from (source rank, expert) blocks to expert-major order
for the grouped GEMM, come back by the mirror all-to-all, and each token sums its k outputs times their gates.
Rows a rank keeps for its own experts never leave it; an expert that receives no token is a zero-row group.
The split sizes are host integers: the counts are read once per layer and micro-batch (dropless routing is
data-dependent; Megatron reads them too).

`allgather` (MoEAllGatherTokenDispatcher): every rank gathers the EP group's tokens and routing, computes its own
experts on the rows routed to them, weights them by their gates, and a reduce-scatter returns each rank its own
tokens' sums (all-gather forward, reduce-scatter backward, and the reverse).

Both count on the EP group's `CommGroup` (bytes = theory: `moe_comm_theory`), and record in `MoEMetrics` the rows
sent to other ranks, which the theory needs (the routing decides them).
"""

from __future__ import annotations

import torch

from mpzero.activations import note_expert_rows
from mpzero.comm import CommGroup
from mpzero.moe.routing import Routing
from mpzero.tensor_parallel import gather_from_sequence_parallel, reduce_scatter_to_sequence_parallel

DISPATCHERS = ("allgather", "alltoall")


class _AllToAll(torch.autograd.Function):
    """Rows to the group's ranks (`send[r]` to rank r) and from them (`recv[r]`); backward sends the gradients back
    the same way reversed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: CommGroup, recv: list[int], send: list[int]) -> torch.Tensor:
        ctx.group, ctx.recv, ctx.send = group, recv, send
        return _exchange(x, group, recv, send)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad.contiguous(), ctx.group, ctx.send, ctx.recv), None, None, None


def _exchange(x: torch.Tensor, group: CommGroup, recv: list[int], send: list[int]) -> torch.Tensor:
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    group.all_to_all_single(out, x.contiguous(), recv, send)
    return out


def _expert_major(counts: torch.Tensor) -> torch.Tensor:
    """For rows received as (source rank, local expert) blocks (`counts` [ranks, E_l], row-major), the index of
    each row of the expert-major order (expert, source rank) in the received order."""
    lengths = counts.reshape(-1)
    starts = torch.cumsum(lengths, 0) - lengths  # each block's first row, received order
    lengths_em, starts_em = counts.t().reshape(-1), starts.view(counts.shape).t().reshape(-1)
    first_em = torch.cumsum(lengths_em, 0) - lengths_em
    total = int(lengths.sum())
    return torch.repeat_interleave(starts_em - first_em, lengths_em, output_size=total) + torch.arange(
        total, device=counts.device)


def alltoall(tokens: torch.Tensor, routing: Routing, experts, ep: CommGroup, num_experts: int,
             metrics=None) -> torch.Tensor:
    """[T, h] tokens -> [T, h]: each token's sum over its kept slots of gate x expert output (module docstring).
    `experts(x, counts)`: this rank's experts on rows sorted by local expert."""
    t, k = routing.indices.shape
    local = num_experts // ep.size
    key = torch.where(routing.kept, routing.indices, num_experts).reshape(-1)  # dropped slots sort last
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    recv_counts = torch.empty_like(counts)
    ep.all_to_all_single(recv_counts, counts)  # [EP, E_l] rows: each rank's counts for the experts here
    both = torch.cat([counts, recv_counts]).tolist()  # the one read of the layer: the split sizes
    send_counts, received = both[:num_experts], both[num_experts:]
    send = [sum(send_counts[r * local:(r + 1) * local]) for r in range(ep.size)]
    recv = [sum(received[r * local:(r + 1) * local]) for r in range(ep.size)]
    sent_order = order[:sum(send)]
    note_expert_rows(sum(recv), sum(send))
    x = tokens[sent_order // k]
    if ep.size > 1:
        x = _AllToAll.apply(x, ep, recv, send)
    by_source = torch.tensor(received, device=tokens.device).view(ep.size, local)
    if ep.size > 1:  # (source, expert) blocks to expert-major rows and back (one source: already so)
        permutation = _expert_major(by_source)
        y = experts(x[permutation], by_source.sum(0).tolist())
        y = _AllToAll.apply(torch.empty_like(y).index_copy(0, permutation, y), ep, send, recv)
    else:
        y = experts(x, received)
    if metrics is not None:  # rows sent to other ranks (both exchanges; backward mirrors them) and the counts
        rows = (sum(send) - send[ep.rank]) + (sum(recv) - recv[ep.rank])
        metrics.ep_bytes += (rows * tokens.shape[-1] * tokens.element_size() * (2 if torch.is_grad_enabled() else 1)
                             + (num_experts - local) * counts.element_size())
    slots = y.new_zeros(t * k, y.shape[-1]).index_copy(0, sent_order, y)
    return _weighted(slots.view(t, k, -1), routing.probs)


def allgather(tokens: torch.Tensor, routing: Routing, experts, ep: CommGroup, num_experts: int,
              metrics=None) -> torch.Tensor:
    """The same sums through an all-gather of the EP group's tokens and routing and a reduce-scatter of the
    outputs (module docstring)."""
    local = num_experts // ep.size
    gather = (lambda x: gather_from_sequence_parallel(x.unsqueeze(0), ep).squeeze(0)) if ep.size > 1 else (
        lambda x: x)
    every, probs = gather(tokens), gather(routing.probs)
    indices, kept = routing.indices, routing.kept
    if ep.size > 1:  # (gloo gathers no bool: the flags travel as bytes)
        indices, kept = _gather_rows(indices, ep), _gather_rows(kept.to(torch.uint8), ep).bool()
    t, k = indices.shape
    mine = kept & (indices // local == ep.rank)
    key = torch.where(mine, indices - ep.rank * local, local).reshape(-1)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=local + 1)[:local].tolist()
    chosen = order[:sum(counts)]
    note_expert_rows(len(chosen))
    y = experts(every[chosen // k], counts)
    slots = y.new_zeros(t * k, y.shape[-1]).index_copy(0, chosen, y)
    out = _weighted(slots.view(t, k, -1), probs)
    if metrics is not None:  # each gather and scatter moves (EP-1) ranks' rows; backward mirrors the float ones
        mirrored = 2 if torch.is_grad_enabled() else 1
        row_bytes = (2 * tokens.shape[-1] * tokens.element_size() + k * routing.probs.element_size()) * mirrored + k * (
            routing.indices.element_size() + 1)
        metrics.ep_bytes += (t // ep.size) * (ep.size - 1) * row_bytes
    return reduce_scatter_to_sequence_parallel(out.unsqueeze(0), ep).squeeze(0) if ep.size > 1 else out


def _gather_rows(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Every rank's rows (no gradient), in rank order."""
    return group.all_gather_cat(x.contiguous(), dim=0)


def _weighted(slots: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """sum over slots of gate x output [T, k, h] -> [T, h], in the gates' dtype (fp32: Megatron's
    --moe-router-dtype weighting), returned in the outputs' dtype."""
    return (slots.to(probs.dtype) * probs.unsqueeze(-1)).sum(dim=1).to(slots.dtype)
