"""Causal self-attention under tensor parallelism: multi-head or grouped-query (K/V groups split across TP with
their query heads), a position-encoding hook (`rotary`: any object with `rotate(q, k, start)`; RoPE,
`models/rotary.py`, or None for learned or no positions), the core attention on the configured backend, selective
recomputation, and the KV cache of inference (`models/kv_cache.py`) through the same forward. It takes its own
section of the model config (`AttentionConfig`), not the model's.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from mpzero.comm import CommGroup
from mpzero.context_parallel import (ContextParallel, block_kernel, context_attention, heads_to_sequence,
                                     sequence_to_heads)
from mpzero.fused import resolve_attention_backend, scaled_masked_softmax
from mpzero.models.blocks import norm
from mpzero.models.rotary import RotaryEmbedding
from mpzero.tensor_parallel import ColumnParallelLinear, InitMethod, RNGStatesTracker, RowParallelLinear, recompute


@dataclass(frozen=True)
class AttentionConfig:
    """What `SelfAttention` needs to know: its shape and how its core attention runs."""
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int  # key/value heads (num_attention_heads without grouped-query attention)
    bias: bool = True  # biases on the QKV and output projections (False: --disable-bias-linear)
    sequence_parallel: bool = False
    dropout: float = 0.0  # --attention-dropout, on the attention probabilities
    backend: str = "auto"  # --attention-backend, resolved per device with the dropout (mpzero.fused.impl)
    softmax_impl: str = "auto"  # the local backend's scale + mask + softmax (mpzero.fused)
    selective: bool = False  # selective recomputation: the core attention recomputed in backward
    qk_norm: tuple | None = None  # --qk-layernorm: (normalization, eps, impl) over each head's q and k; None: off
    kv_channels: int | None = None  # --kv-channels: each head's size; None: hidden_size / num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads


class SelfAttention(nn.Module):
    """Causal multi-head attention; this TP rank computes heads [r*n/tp, (r+1)*n/tp). Grouped-query attention
    (g key/value heads, each shared by n/g query heads): this rank holds groups [r*g/tp, (r+1)*g/tp) with their
    query heads. The fused QKV weight is laid out group by group ([g, (n/g q heads, k, v), head_dim] rows; head by
    head, [heads, (q,k,v), head_dim], without GQA), so a contiguous column-parallel split hands each rank whole
    groups. RoPE (`rotary`, shared by the model's layers) rotates q and k per rank. `init` draws the full QKV
    weight, `output_init` the projection's. The core attention runs on the configured backend
    (`resolve_attention_backend`: torch's scaled_dot_product_attention for flash and fused,
    explicit [s, s] scores for local and unfused), resolved for the device of its input. Selective recomputation
    keeps the QKV output (q, k and v are its views) and recomputes the core attention in backward, its dropout
    masks replayed from the saved RNG states. With flash attention it still does so when asked, although flash
    keeps no [s, s] tensor (Megatron calls selective recomputation unnecessary there): it then saves only the
    kernel's fp32 logsumexp, at the cost of one more attention forward."""

    def __init__(self, config: AttentionConfig, tp: CommGroup, init: InitMethod, output_init: InitMethod,
                 rng: RNGStatesTracker | None = None, rotary: RotaryEmbedding | None = None,
                 context: ContextParallel | None = None):
        """`context`: this rank holds 1/CP of the sequence (`mpzero.context_parallel`); None without CP."""
        super().__init__()
        self.context = context
        h, self.head_dim = config.hidden_size, config.head_dim
        self.local_heads = config.num_attention_heads // tp.size
        self.local_groups = config.num_query_groups // tp.size
        self.rng, self.dropout, self.softmax_impl = rng, config.dropout, config.softmax_impl
        self.config, self.rotary, self.selective = config, rotary, config.selective
        sp, bias = config.sequence_parallel, config.bias
        width = (config.num_attention_heads + 2 * config.num_query_groups) * self.head_dim  # 3h without GQA
        self.qkv = ColumnParallelLinear(h, width, tp, init, bias=bias, sequence_parallel=sp)
        # the heads' outputs (heads x head size: h unless --kv-channels says otherwise) back to h
        self.dense = RowParallelLinear(config.num_attention_heads * self.head_dim, h, tp, output_init, bias=bias,
                                       sequence_parallel=sp)
        self.q_layernorm = self.k_layernorm = None
        if config.qk_norm is not None:  # [head_dim] weights shared by the heads of every TP rank: their gradients
            normalization, eps, impl = config.qk_norm  # are summed over TP (each rank's heads give a part)
            self.q_layernorm, self.k_layernorm = (norm(normalization, self.head_dim, eps, impl, tp) for _ in "qk")

    def backend(self, device: torch.device) -> str:
        """flash, fused, unfused or local: the core attention this module runs on `device`."""
        return resolve_attention_backend(self.config.backend, device, dropout=self.config.dropout)

    def forward(self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                start: int = 0) -> torch.Tensor:
        """x [b, s(/tp), h] -> [b, s(/tp), h]. With `cache` (this layer's keys and values, `KVCache.layer`):
        inference at positions [start, start + s), the new keys and values appended, attention over all."""
        qkv = self.qkv(x)  # [b, s, 3h/tp]: the whole sequence, also when x is a sequence-parallel slice
        b, s = qkv.shape[:2]
        dropout = self.dropout if self.training else 0.0
        if cache is not None:
            context = self._cached_attention(qkv, *cache, start)
        elif self.selective and self.training:  # keeps qkv itself (whose views q, k, v are), not copies
            context = recompute(partial(self._core_attention, dropout=dropout), self.rng, qkv)
        else:
            context = self._core_attention(qkv, dropout)
        return self.dense(context.transpose(1, 2).reshape(b, s, -1))  # [b, s, heads*d/tp] in, [b, s(/tp), h] out

    def split_heads(self, qkv: torch.Tensor, start=0):
        """qkv [b, s, width] at positions [start, start + s) (or those of a CP layout, `ZigzagChunks`) -> q
        [b, heads, s, head_dim] and k, v [b, groups, s, head_dim], RoPE applied to q and k: the local heads and
        groups, or 1/CP of them under --cp-comm-type a2a (the width says which). The rows are laid out group by
        group, each group its query heads then its key and its value head (Megatron's GQA layout; [heads, (q, k,
        v), head_dim] without GQA), so a contiguous column-parallel split hands each rank whole groups."""
        b, s = qkv.shape[:2]
        per_group = self.local_heads // self.local_groups
        groups = qkv.size(2) // ((per_group + 2) * self.head_dim)
        x = qkv.view(b, s, groups, per_group + 2, self.head_dim)
        # query head i uses group i // per_group; q stays laid out [b, s, heads, hd] (a view of qkv with one
        # group per rank, else a copy) like k and v, so attention's output is too and the projection reads a view.
        # One split, not three index views: its backward writes the three gradients into one qkv-sized tensor,
        # where each index view's backward zero-fills a qkv-sized tensor of its own and autograd adds the three
        q, k, v = x.split([per_group, 1, 1], dim=3)
        q = q.reshape(b, s, groups * per_group, self.head_dim).transpose(1, 2)
        k, v = k.squeeze(3).transpose(1, 2), v.squeeze(3).transpose(1, 2)
        if self.q_layernorm is not None:  # before RoPE, as Megatron's and HF Qwen3's q_norm and k_norm
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if self.rotary is not None:
            q, k = self.rotary.rotate(q, k, start)  # a method, not a module call: no hooks inside a replay
        return q, k, v

    def _cached_attention(self, qkv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          start: int) -> torch.Tensor:
        """The core attention of positions [start, start + s) over the cached keys and values before them and
        their own (written into the cache): query i (position start + i) sees keys [0, start + i]."""
        q, k, v = self.split_heads(qkv, start)  # q [b, heads, s, d]; k, v [b, groups, s, d]
        s = q.size(2)
        keys[:, :, start:start + s], values[:, :, start:start + s] = k, v
        backend = self.backend(qkv.device)
        if start == 0:  # the prompt: the model's own causal attention
            return self.attend(q, k, v, 0.0, backend)
        k, v = keys[:, :, :start + s], values[:, :, :start + s]
        future = None  # one new position sees every key
        if s > 1:
            future = torch.arange(start + s, device=q.device) > torch.arange(start, start + s, device=q.device)[:, None]
        if backend in ("flash", "fused"):  # any SDPA kernel: cuDNN's needs no mask of its own here
            return F.scaled_dot_product_attention(q, k, v, attn_mask=None if future is None else ~future,
                                                  enable_gqa=k.size(1) != q.size(1))
        if k.size(1) != q.size(1):  # each group's keys and values for each of its query heads
            k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
        scores = torch.matmul(q, k.transpose(-1, -2))  # [b, local_heads, s, start + s]
        probs = scaled_masked_softmax(scores, 1.0 / math.sqrt(self.head_dim), causal=False, mask=future,
                                      impl="torch" if backend == "unfused" else self.softmax_impl)
        return torch.matmul(probs, v)

    def _core_attention(self, qkv: torch.Tensor, dropout: float) -> torch.Tensor:
        if self.context is not None:
            return self._context_parallel_attention(qkv)
        q, k, v = self.split_heads(qkv)
        # heads differ across TP ranks, so must their dropout masks (no dropout: nothing drawn, no RNG state
        # swapped, which torch.compile would have to break around)
        with self.rng.fork() if self.rng is not None and dropout > 0 else contextlib.nullcontext():
            return self.attend(q, k, v, dropout, self.backend(qkv.device))

    def _context_parallel_attention(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [b, L, width] of this CP rank's L tokens -> their attention output [b, heads, L, head_dim] over the
        whole sequence: the ring or all-gather of keys and values (RoPE and the mask at the tokens' global
        positions), or the all-to-all to 1/CP of the heads over the whole sequence in order, and back."""
        context, b, length = self.context, qkv.size(0), qkv.size(1)
        layout = context.layout(length)
        if context.comm_type != "a2a":
            q, k, v = self.split_heads(qkv, layout)
            kernel = block_kernel(self.config.backend, qkv.device.type)
            return context_attention(q, k, v, context.group, context.comm_type, 1.0 / math.sqrt(self.head_dim), kernel)
        q, k, v = self.split_heads(heads_to_sequence(qkv, context.group, layout))  # [b, heads/CP, s, d]
        out = self.attend(q, k, v, 0.0, self.backend(qkv.device)).transpose(1, 2).reshape(b, layout.seq_length, -1)
        return sequence_to_heads(out, context.group, layout).view(b, length, -1, self.head_dim).transpose(1, 2)

    def attend(self, q, k, v, dropout: float, backend: str) -> torch.Tensor:
        """Causal attention of q [b, local_heads, s, head_dim] over k, v [b, local_groups, s, head_dim] on
        `backend` (GQA: SDPA's enable_gqa on flash; the local path repeats each group's k, v for its heads)."""
        if k.size(1) != q.size(1) and backend not in ("flash", "fused"):
            k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
        if backend == "flash":
            return self._flash(q, k, v, dropout)
        if backend == "fused":
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return self._flash(q, k, v, dropout)
        return self._core(q, k, v, dropout, "torch" if backend == "unfused" else self.softmax_impl)

    def _core(self, q, k, v, dropout: float, softmax_impl: str) -> torch.Tensor:
        """Megatron's core attention: explicit scores, fused scale + causal mask + softmax, dropout."""
        scores = torch.matmul(q, k.transpose(-1, -2))  # [b, local_heads, s, s]
        probs = scaled_masked_softmax(scores, 1.0 / math.sqrt(self.head_dim), causal=True, impl=softmax_impl)
        return torch.matmul(F.dropout(probs, dropout) if dropout > 0 else probs, v)  # [b, local_heads, s, hd]

    def _flash(self, q, k, v, dropout: float) -> torch.Tensor:
        """The same maths in one kernel that never materializes [s, s] (FlashAttention on GPUs)."""
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                              enable_gqa=k.size(1) != q.size(1))
