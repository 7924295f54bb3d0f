"""The key/value cache that inference passes through the model's own forward (`GPTModel.forward(tokens,
cache=cache)`, as Megatron's inference context and nanoGPT's generate): each layer's attention appends the keys
and values of the new positions and attends over every cached one, so generation needs no second forward."""

from __future__ import annotations

import torch
from torch import nn


class KVCache:
    """Every layer's keys and values for positions [0, length), this rank's key/value heads (its query groups
    under GQA: the cache is heads/groups times smaller): [batch, local_groups, max_length, head_dim] each, RoPE
    already applied to the keys. `length` advances by the positions of each forward given the cache."""

    def __init__(self, model: nn.Module, batch: int, max_length: int):
        attention = model.layers[0].attention
        weight = attention.qkv.weight
        shape = (batch, attention.local_groups, max_length, attention.head_dim)
        self.keys = [torch.zeros(shape, dtype=weight.dtype, device=weight.device) for _ in model.layers]
        self.values = [torch.zeros(shape, dtype=weight.dtype, device=weight.device) for _ in model.layers]
        self.length = 0

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's (keys, values), written in place by its attention."""
        return self.keys[i], self.values[i]
