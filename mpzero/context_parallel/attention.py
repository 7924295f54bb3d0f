"""Causal attention of this context-parallel rank's queries over the whole sequence's keys and values, forward and
backward, as one autograd function (`context_attention`): the K/V of the other CP ranks arrive through a transport
(`transports.py`: the ring, or an all-gather), each step's block is computed with its log-sum-exp and merged
(`blocks.py`), and backward recomputes the blocks from the saved output and log-sum-exp and sends each source's
dK/dV back to it (the ring's circulation, or a reduce-scatter).

What it keeps for backward is what FlashAttention keeps: q, k and v as given (views of the QKV output where
`SelfAttention.split_heads` makes views), the output (laid out [b, L, heads, d], so the output projection reads a
view of it) and an fp32 log-sum-exp per head and position; the other ranks' K/V are fetched again in backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpzero.comm import CommGroup
from mpzero.context_parallel.chunks import ZigzagChunks
from mpzero.context_parallel.blocks import backward_blocks, forward_blocks, schedule
from mpzero.context_parallel.kernels import KERNELS
from mpzero.context_parallel.transports import TRANSPORTS


class _ContextAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group: CommGroup, comm_type: str, scale: float, kernel: str):
        """q [b, heads, L, d], k, v [b, groups, L, d] (L local tokens, this rank's two chunks) -> [b, L, heads, d]."""
        b, heads, length, d = q.shape
        groups = k.size(1)
        steps = schedule(group.rank, group.size)
        transport = TRANSPORTS[comm_type](group)
        kv = transport.stream(torch.stack([k, v]))  # [2, b, g, L, d]: one message per step, held by the stream alone
        out, lse = forward_blocks(q.unflatten(1, (groups, heads // groups)), kv, steps, scale, KERNELS[kernel][0])
        result = torch.empty(b, length, heads, d, dtype=q.dtype, device=q.device)
        result.view(b, length, groups, heads // groups, d).copy_(out.permute(0, 3, 1, 2, 4))
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.group, ctx.comm_type, ctx.scale, ctx.kernel = group, comm_type, scale, kernel
        return result

    @staticmethod
    def backward(ctx, dresult):
        q, k, v, result, lse = ctx.saved_tensors
        group = ctx.group
        b, heads, length, d = q.shape
        groups = k.size(1)
        steps = schedule(group.rank, group.size)
        transport = TRANSPORTS[ctx.comm_type](group)

        def grouped(x):  # [b, L, heads, d] -> [b, g, n, L, d]
            return x.view(b, length, groups, heads // groups, d).permute(0, 2, 3, 1, 4)
        sink = transport.sink()
        dq = backward_blocks(q.unflatten(1, (groups, heads // groups)), lse, grouped(dresult), grouped(result),
                             transport.stream(torch.stack([k, v])), steps, ctx.scale, sink, KERNELS[ctx.kernel][1])
        dkv = sink.result()
        return dq.flatten(1, 2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: CommGroup, comm_type: str,
                      scale: float, kernel: str = "local") -> torch.Tensor:
    """Causal attention of the local queries q [b, heads, L, d] over every CP rank's keys and values (k, v
    [b, groups, L, d], grouped-query attention sent as it is) -> [b, heads, L, d], a view of a [b, L, heads, d]
    tensor. `comm_type`: "p2p" (ring) or "all_gather"; `kernel`: how a block is computed, "local" or "flash"
    (`kernels.block_kernel`)."""
    return _ContextAttention.apply(q, k, v, group, comm_type, scale, kernel).transpose(1, 2)


@dataclass(frozen=True)
class ContextParallel:
    """This rank's CP group and how its attention exchanges (`--cp-comm-type`): what the model's attention and
    embedding take (None without context parallelism)."""
    group: CommGroup
    comm_type: str

    def layout(self, local_length: int) -> ZigzagChunks:
        """The split of the sequence whose `local_length` tokens this rank holds."""
        return ZigzagChunks(local_length * self.group.size, self.group.size, self.group.rank)
