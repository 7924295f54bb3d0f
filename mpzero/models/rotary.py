"""Rotary position embeddings (Su et al. 2021) with HF's rotate-half convention ("GPT-NeoX style", Megatron's
`rotary_interleaved=False`): the first `rot_dim` features of every head are paired as (i, i + rot_dim/2), not
(2i, 2i + 1) as in Meta's reference, so HF `LlamaForCausalLM` weights load without any q/k permutation.

    inv_freq_i = base^(-2i / rot_dim), i < rot_dim / 2;  angle(t, i) = t * inv_freq_i
    cos, sin = cos/sin(cat(angle, angle))                  # [positions, rot_dim], fp32
    rope(x) = x * cos + rotate_half(x) * sin,  rotate_half(x) = cat(-x[..., rot_dim/2:], x[..., :rot_dim/2])

`rot_dim` = head_dim x --rotary-percent (Megatron's partial rotary); features past it pass through unchanged.
cos and sin are computed in fp32 (bf16 angles lose precision at long contexts, transformers PR #29285) and cast
to the activations' dtype where they are applied. They are non-persistent buffers computed by `rope_cos_sin`
computed once on the host and moved to the device of the activations they rotate. A context-parallel rank's
tokens sit at the positions of its two chunks (`mpzero.context_parallel.ZigzagChunks`): their rows of the tables
are taken once per layout and kept beside the tables (2 x 4 bytes x s/CP x rot_dim), not per layer and step.
"""

from __future__ import annotations

import torch
from torch import nn


def rope_cos_sin(positions: int, rot_dim: int, base: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [positions, rot_dim] in fp32 for positions 0..positions-1."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device) / rot_dim)
    angles = torch.outer(torch.arange(positions, dtype=torch.float32, device=device), inv_freq)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.size(-1) // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_half_transposed(g: torch.Tensor) -> torch.Tensor:
    """The adjoint of `_rotate_half`: cat(g2, -g1)."""
    half = g.size(-1) // 2
    return torch.cat((g[..., half:], -g[..., :half]), dim=-1)


class _Rotate(torch.autograd.Function):
    """rope(x) with its exact backward, the rotation by the opposite angle: dx = g cos + rotate_half^T(g) sin.
    It keeps nothing for backward but references to the cos/sin tables' rows (the model's buffers, not
    activations: casting them in backward again spares a per-layer copy in bf16)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.cos, ctx.sin = cos, sin
        return x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.cos.to(g.dtype) + _rotate_half_transposed(g) * ctx.sin.to(g.dtype), None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, head_dim] rotated by cos, sin [s, rot_dim] on its first rot_dim features."""
    rot_dim = cos.size(-1)
    if rot_dim == x.size(-1):
        return _Rotate.apply(x, cos, sin)
    # joined along the features in x's [b, s, heads, d] memory order, as the whole rotation's output is: attention's
    # output then keeps that order and the projection reads it as a view (a [b, heads, s, d]-ordered concatenation
    # makes the projection copy it, one more q-sized tensor kept for backward)
    rotated = _Rotate.apply(x[..., :rot_dim], cos, sin).transpose(1, 2)
    return torch.cat((rotated, x[..., rot_dim:].transpose(1, 2)), dim=-1).transpose(1, 2)


class RotaryEmbedding(nn.Module):
    """The cos/sin tables of every position (non-persistent buffers: not in checkpoints, moved with the model).
    One per model, shared by its attention layers; each TP rank rotates its own heads with the same tables."""

    def __init__(self, max_positions: int, rot_dim: int, base: float, device=None):
        super().__init__()
        self.max_positions, self.rot_dim, self.base = max_positions, rot_dim, base
        cos, sin = rope_cos_sin(max_positions, rot_dim, base, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self._at_layout: dict = {}  # {ZigzagChunks: (cos, sin) at its positions}

    def follow(self, device: torch.device) -> None:
        """The tables moved to `device` if they are elsewhere (computed on the host once, moved as they are: a model
        whose parameters ZeRO made on the device). A compiled trunk has them moved before it is called: one traced
        with host tables would copy them in every call, and CUDA graphs cannot capture a host input."""
        if self.cos.device != device:
            self.cos, self.sin = self.cos.to(device), self.sin.to(device)
            self._at_layout = {}

    def rotate(self, q: torch.Tensor, k: torch.Tensor, start=0) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k [b, heads, s, head_dim] at positions [start, start + s), or at a context-parallel layout's
        (`start` a `ZigzagChunks`), rotated. The tables follow q's device."""
        self.follow(q.device)
        if isinstance(start, int):
            s = q.size(2)
            cos, sin = self.cos[start:start + s], self.sin[start:start + s]
        else:
            if start not in self._at_layout:
                positions = start.positions(self.cos.device)
                self._at_layout[start] = (self.cos[positions], self.sin[positions])
            cos, sin = self._at_layout[start]
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
