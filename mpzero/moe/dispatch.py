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

`balanced_routing()`: only for `pretrain_gpt.py --dry-run`, whose tensors hold no data, so no split size can be read
from them: inside it the dispatchers take the split sizes of a stated routing instead, slot i of a rank's D k slots
to expert i mod E (`balanced_counts`: every expert its share, the same on every rank), and run the rest of their
code (the exchanges, the experts, the weighting) on those sizes.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch

from mpzero.activations import note_expert_rows
from mpzero.comm import CommGroup
from mpzero.moe.routing import Routing
from mpzero.tensor_parallel import gather_from_sequence_parallel, reduce_scatter_to_sequence_parallel

DISPATCHERS = ("allgather", "alltoall")
_BALANCED: ContextVar = ContextVar("mpzero_balanced_routing", default=False)  # inside `balanced_routing`


@contextlib.contextmanager
def balanced_routing():
    """The dispatchers' split sizes are `balanced_counts`'s, not the routing's (the dry run's, module docstring)."""
    token = _BALANCED.set(True)
    try:
        yield
    finally:
        _BALANCED.reset(token)


def balanced_counts(slots: int, num_experts: int) -> list[int]:
    """Slots per expert when slot i goes to expert i mod E: slots // E each, one more for the first slots % E."""
    return [slots // num_experts + (e < slots % num_experts) for e in range(num_experts)]


def _split_sizes(counts: torch.Tensor, recv_counts: torch.Tensor, ep: CommGroup, num_experts: int,
                 slots: int) -> tuple[list[int], list[int]]:
    """(slots this rank sends to each expert, slots each source rank sends to each local expert, source-major):
    read from the counts, or under `balanced_routing` the stated routing's (every rank sends alike)."""
    if not _BALANCED.get():
        both = torch.cat([counts, recv_counts]).tolist()  # the one read of the layer: the split sizes
        return both[:num_experts], both[num_experts:]
    send = balanced_counts(slots, num_experts)
    local = num_experts // ep.size
    return send, send[ep.rank * local:(ep.rank + 1) * local] * ep.size


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


def _expert_major(counts: torch.Tensor, total: int) -> torch.Tensor:
    """For `total` rows received as (source rank, local expert) blocks (`counts` [ranks, E_l], row-major), the
    index of each row of the expert-major order (expert, source rank) in the received order."""
    lengths = counts.reshape(-1)
    starts = torch.cumsum(lengths, 0) - lengths  # each block's first row, received order
    lengths_em, starts_em = counts.t().reshape(-1), starts.view(counts.shape).t().reshape(-1)
    first_em = torch.cumsum(lengths_em, 0) - lengths_em
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
    counts = per_expert(key, num_experts)
    recv_counts = torch.empty_like(counts)
    ep.all_to_all_single(recv_counts, counts)  # [EP, E_l] rows: each rank's counts for the experts here
    send_counts, received = _split_sizes(counts, recv_counts, ep, num_experts, t * k)
    send = [sum(send_counts[r * local:(r + 1) * local]) for r in range(ep.size)]
    recv = [sum(received[r * local:(r + 1) * local]) for r in range(ep.size)]
    sent_order = order[:sum(send)]
    note_expert_rows(sum(recv), sum(send))
    x = tokens[sent_order // k]
    if ep.size > 1:
        x = _AllToAll.apply(x, ep, recv, send)
    by_source = torch.tensor(received, device=tokens.device).view(ep.size, local)
    if ep.size > 1:  # (source, expert) blocks to expert-major rows and back (one source: already so)
        permutation = _expert_major(by_source, sum(recv))
        y = experts(x[permutation], [sum(received[e::local]) for e in range(local)])
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
    if _BALANCED.get():  # every source rank's slots alike: EP x its counts for these experts
        counts = [ep.size * c for c in balanced_counts(t // ep.size * k, num_experts)[ep.rank * local:
                                                                                        (ep.rank + 1) * local]]
    else:
        counts = per_expert(key, local).tolist()
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


def per_expert(key: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Slots per expert of `key` (an expert index per slot; `num_experts` for a slot that goes nowhere), [E] int64:
    a scatter-add, whose output's shape does not depend on the data (a bincount's does)."""
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=key.device)
    return counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int64))[:num_experts]


def _gather_rows(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Every rank's rows (no gradient), in rank order."""
    return group.all_gather_cat(x.contiguous(), dim=0)


def _weighted(slots: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """sum over slots of gate x output [T, k, h] -> [T, h], in the gates' dtype (fp32: Megatron's
    --moe-router-dtype weighting), returned in the outputs' dtype."""
    return (slots.to(probs.dtype) * probs.unsqueeze(-1)).sum(dim=1).to(slots.dtype)
