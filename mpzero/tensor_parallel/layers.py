"""Megatron's tensor-parallel layers: column- and row-parallel linears and the vocab-parallel embedding.

Initialization is TP-invariant: every rank builds the FULL weight from the (identically seeded) default
generator and keeps its own slice, so a model at TP=2 starts from exactly the weights it has at TP=1.
Every parameter is marked with how it is split (`placement.mark_tensor_parallel`), so gradient norms,
checkpoints and export can gather or reshard it generically.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mpzero.comm import CommGroup
from mpzero.errors import ConfigError
from mpzero.tensor_parallel.mappings import copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp
from mpzero.tensor_parallel.placement import mark_tensor_parallel

InitMethod = Callable[[torch.Tensor], None]


def sharded_parameter(full_shape: tuple[int, ...], partition_dim: int, group: CommGroup,
                      init_method: InitMethod, device=None) -> nn.Parameter:
    full = torch.empty(full_shape, dtype=torch.float32)
    init_method(full)  # drawn identically on every rank, whatever the TP size
    shard = full.chunk(group.size, dim=partition_dim)[group.rank].contiguous()
    return mark_tensor_parallel(nn.Parameter(shard.to(device)), partition_dim)


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts != 0:
        raise ConfigError(f"{what} {total} is not divisible by --tensor-model-parallel-size {parts}")
    return total // parts


def _bias(size: int, partition_dim: int | None, device) -> nn.Parameter:
    return mark_tensor_parallel(nn.Parameter(torch.zeros(size, device=device)), partition_dim)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's rows (output features) split across the TP group; y stays sharded
    unless `gather_output`. The input is replicated, so its gradient is all-reduced on the way back."""

    def __init__(self, in_features: int, out_features: int, group: CommGroup, init_method: InitMethod,
                 bias: bool = True, gather_output: bool = False, device=None):
        super().__init__()
        self.group, self.gather_output = group, gather_output
        local_out = _divide(out_features, group.size, "output size")
        self.weight = sharded_parameter((out_features, in_features), 0, group, init_method, device)
        self.bias = _bias(local_out, 0, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tp(x, self.group), self.weight, self.bias)  # [..., out/tp]
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's columns (input features) split across the TP group: each rank computes a
    partial product from its input shard, the partials are all-reduced, then the replicated bias is added."""

    def __init__(self, in_features: int, out_features: int, group: CommGroup, init_method: InitMethod,
                 bias: bool = True, input_is_parallel: bool = True, device=None):
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        _divide(in_features, group.size, "input size")
        self.weight = sharded_parameter((out_features, in_features), 1, group, init_method, device)
        self.bias = _bias(out_features, None, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        y = reduce_from_tp(F.linear(x, self.weight), self.group)  # [..., out], full sum
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table [vocab, h] with its rows split across the TP group: rank r owns ids
    [r*V/tp, (r+1)*V/tp); ids elsewhere look up zeros here and the all-reduce fills them in."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: CommGroup, init_method: InitMethod,
                 device=None):
        super().__init__()
        self.group = group
        self.num_local = _divide(num_embeddings, group.size, "padded vocabulary size")
        self.vocab_start = group.rank * self.num_local
        self.weight = sharded_parameter((num_embeddings, embedding_dim), 0, group, init_method, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)


def gather_full(tensor: torch.Tensor, partition_dim: int | None, group: CommGroup) -> torch.Tensor:
    """The unsharded tensor from every TP rank's shard (for export, checks and checkpoint conversion)."""
    if partition_dim is None or group.size == 1:
        return tensor.detach().clone()
    return group.all_gather_cat(tensor.detach(), dim=partition_dim)
