"""--cp-comm-type a2a (DeepSpeed-Ulysses): an all-to-all trades the sequence split for a head split around the
attention, which then runs on the whole sequence, for 1/CP of the heads, on any attention backend.

Before the attention, `heads_to_sequence` sends the QKV output of this rank's L = s/CP tokens ([b, L, W], W the
local width, laid out group by group: each key/value group with its query heads, its key and its value) to the
ranks that own each group: CP rank j receives groups [j g/CP, (j+1) g/CP) of every rank's tokens, and puts the
tokens back in sequence order, so RoPE, the causal mask and the kernels see positions 0..s-1 as without CP.
Grouped-query attention's smaller K/V go as they are. After it, `sequence_to_heads` sends each rank's heads of
every token back to the rank that holds the token. Each all-to-all keeps 1/CP of its input and sends the rest:
per layer and rank, forward (CP-1)/CP of the QKV output and of the attention output, backward the same for their
gradients (DeepSpeed's 4Nh/P per link for h = W/3 without GQA).
"""

from __future__ import annotations

import torch

from mpzero.comm import CommGroup
from mpzero.context_parallel.chunks import ZigzagChunks


class _AllToAll(torch.autograd.Function):
    """out[j] <- rank j's x[this rank], for x [CP, ...]; its own transpose, so backward is the same exchange."""

    @staticmethod
    def forward(ctx, x, group: CommGroup):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        group.all_to_all_single(out, x)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        ctx.group.all_to_all_single(out, grad)
        return out, None


def heads_to_sequence(qkv: torch.Tensor, group: CommGroup, layout: ZigzagChunks) -> torch.Tensor:
    """[b, L, W] (this rank's tokens, all its heads) -> [b, s, W/CP] (every token in order, 1/CP of the groups)."""
    b, length, width = qkv.shape
    cp, c = group.size, layout.chunk
    parts = qkv.view(b, length, cp, width // cp).permute(2, 0, 1, 3)  # [CP, b, L, W/CP]: part j goes to rank j
    received = _AllToAll.apply(parts.contiguous(), group)  # [CP (source rank), b, L, W/CP]
    chunks = received.view(cp, b, 2, c, width // cp)  # rank j's half h: chunks[j, :, h]
    natural = [chunks[i // 2, :, i % 2] for i in layout.natural_chunk_order()]
    return torch.cat(natural, dim=1)  # [b, s, W/CP]; a cat of views keeps no index for backward


def sequence_to_heads(context: torch.Tensor, group: CommGroup, layout: ZigzagChunks) -> torch.Tensor:
    """[b, s, H] (every token in order, this rank's 1/CP of the heads) -> [b, L, CP H] (this rank's tokens)."""
    b, _, width = context.shape
    cp, c = group.size, layout.chunk
    chunks = context.view(b, 2 * cp, c, width)
    order = layout.rank_major_chunk_order()  # rank j's two chunks at 2j, 2j + 1
    parts = torch.stack([torch.cat([chunks[:, order[2 * j]], chunks[:, order[2 * j + 1]]], dim=1) for j in range(cp)])
    received = _AllToAll.apply(parts, group)  # [CP (source rank: its heads), b, L, H]
    return received.permute(1, 2, 0, 3).reshape(b, 2 * c, cp * width)
