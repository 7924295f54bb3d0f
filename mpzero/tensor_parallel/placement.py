"""The per-parameter partitioning contract between a model and everything that reshards its state.

Every parameter a model hands to ZeRO says how it is split across the tensor-parallel group:
`mark_tensor_parallel(param, partition_dim)` (a dimension: sharded along it; None: replicated, identical
values and gradients on every TP rank). `placement_of` reads the mark back as a `TensorPlacement`, and
refuses an unmarked parameter with one line naming it: the gradient norm (which counts a replicated
parameter once), checkpoints (which store global shapes) and export all depend on the mark being right,
so a missing one must fail at construction, not be guessed. The TP layers mark their own parameters; a
model built from plain `torch.nn` layers at TP 1 marks them all replicated with `mark_replicated(model)`.

An expert parameter (a mixture-of-experts layer's stacked experts, `expert=True`) names a second axis: its
dimension 0 holds this rank's experts, the global tensor being the experts of every expert-parallel rank in rank
order (rank r holds experts [r E/ep, (r+1) E/ep)); its `partition_dim` then splits each expert over the
expert-tensor-parallel group (`ParallelGroups.expert_tp`), and ZeRO partitions it over the expert-data-parallel
group (`ParallelGroups.expert_dp`), not over DP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mpzero.errors import ConfigError

_UNMARKED = object()


@dataclass(frozen=True)
class TensorPlacement:
    """A parameter's TP layout: its TP-local shape, split dimension (None: replicated), real extent along
    it (None: the whole extent; the vocabulary is padded past its real size) and `chunks`: the global tensor is
    that many equal blocks along the split dimension, each split across TP, rank r holding the r-th slice of
    every block in order (Megatron's stride; 2 for SwiGLU's [gate; up], so each rank holds [gate_r; up_r]).
    `expert`: dimension 0 holds this expert-parallel rank's experts (the module docstring); `partition_dim` and
    `chunks` then split over the expert-TP group, whose size `global_shape`'s `tp_size` is."""
    local_shape: tuple[int, ...]
    partition_dim: int | None
    unpadded_size: int | None = None
    chunks: int = 1
    expert: bool = False

    @property
    def is_sharded(self) -> bool:
        return self.partition_dim is not None

    def global_shape(self, tp_size: int, ep_size: int = 1) -> tuple[int, ...]:
        """The whole tensor's shape: split dimension times the (expert-)TP size, experts times the EP size."""
        shape = list(self.local_shape)
        if self.partition_dim is not None:
            shape[self.partition_dim] = self.unpadded_size or shape[self.partition_dim] * tp_size
        if self.expert:
            shape[0] *= ep_size
        return tuple(shape)


def mark_tensor_parallel(param: nn.Parameter, partition_dim: int | None,
                         unpadded_size: int | None = None, chunks: int = 1, expert: bool = False) -> nn.Parameter:
    """partition_dim None means replicated across the TP group (identical values and gradients).
    unpadded_size: the real extent along partition_dim when the full tensor is padded past it (the
    vocabulary), so checkpoints store only real rows and reload at any TP size. chunks: see TensorPlacement.
    expert: dimension 0 holds this rank's experts (an [experts, ...] stack of 2-D expert weights), split over
    expert parallelism; partition_dim then names a dimension of each expert's weight past it (1 or 2)."""
    if partition_dim is not None and not int(expert) <= partition_dim < param.ndim:
        raise ConfigError(f"partition_dim {partition_dim} is not a dimension of a {param.ndim}-D "
                          f"{'expert ' if expert else ''}parameter")
    rows = 1 if expert else 0
    if chunks != 1 and (partition_dim != rows or unpadded_size is not None):
        raise ConfigError(f"chunks > 1 needs partition_dim {rows} and no padding (SwiGLU's [gate; up] rows)")
    if expert and (param.ndim not in (2, 3) or unpadded_size is not None):
        raise ConfigError("an expert parameter is a stack of 1-D or 2-D expert weights ([experts, ...]) without "
                          "padding")
    param.tensor_parallel = partition_dim is not None
    param.partition_dim = partition_dim
    param.unpadded_size = unpadded_size
    param.partition_chunks = chunks
    param.expert_parallel = expert
    return param


def tp_slice(full: torch.Tensor, partition_dim: int, tp_size: int, tp_rank: int, chunks: int = 1) -> torch.Tensor:
    """TP rank `tp_rank`'s shard of the full tensor: its 1/tp slice of each of the `chunks` blocks along
    `partition_dim`, concatenated (chunks 1: the plain contiguous split, a view). The one way shards are cut."""
    if chunks == 1:
        return full.chunk(tp_size, dim=partition_dim)[tp_rank]
    blocks = full.chunk(chunks, dim=partition_dim)
    return torch.cat([block.chunk(tp_size, dim=partition_dim)[tp_rank] for block in blocks], partition_dim)


def tp_unslice(shards: list[torch.Tensor], partition_dim: int, chunks: int = 1) -> torch.Tensor:
    """The full tensor from every TP rank's shard (`tp_slice`'s inverse)."""
    pieces = [shard.chunk(chunks, dim=partition_dim) for shard in shards]
    return torch.cat([rank_pieces[j] for j in range(chunks) for rank_pieces in pieces], partition_dim)


def mark_replicated(module: nn.Module) -> nn.Module:
    """Mark every not yet marked parameter of `module` as replicated across TP (a plain model at TP 1)."""
    for param in module.parameters():
        if getattr(param, "partition_dim", _UNMARKED) is _UNMARKED:
            mark_tensor_parallel(param, None)
    return module


def placement_of(name: str, param: nn.Parameter) -> TensorPlacement:
    partition_dim = getattr(param, "partition_dim", _UNMARKED)
    if partition_dim is _UNMARKED:
        raise ConfigError(f"parameter {name!r} does not say how it is split across tensor-parallel ranks: build it "
                          "with mpzero.tensor_parallel layers, or call mark_tensor_parallel(param, dim or None) "
                          "or mark_replicated(model) before handing the model to ZeroOptimizer")
    if partition_dim is not None and not (isinstance(partition_dim, int) and 0 <= partition_dim < param.ndim):
        raise ConfigError(f"parameter {name!r} has partition_dim {partition_dim!r}, not a dimension of its "
                          f"{param.ndim}-D shape: fix its mark_tensor_parallel call")
    return TensorPlacement(tuple(param.shape), partition_dim, getattr(param, "unpadded_size", None),
                           getattr(param, "partition_chunks", 1), is_expert(param))


def placements(named_params) -> dict[str, TensorPlacement]:
    """{name: placement} for (name, parameter) pairs; the first unmarked parameter is a ConfigError."""
    return {name: placement_of(name, param) for name, param in named_params}


def is_expert(param: nn.Parameter) -> bool:
    """Whether the parameter is an expert stack split over expert parallelism (`mark_tensor_parallel(expert=True)`):
    ZeRO partitions it over the expert-data-parallel group."""
    return getattr(param, "expert_parallel", False)


def mark_pipeline_tied(param: nn.Parameter, copy: bool) -> nn.Parameter:
    """A parameter held by two pipeline stages (GPT-2's word embedding: the first stage's input, the last stage's
    output layer): its gradient is the sum of both stages' (ZeRO adds them before the step, so both copies take the
    same update). `copy`: this is the second stage's, which the norm and checkpoints leave to the first."""
    param.pipeline_tied, param.pipeline_copy = True, copy
    return param


def is_pipeline_tied(param: nn.Parameter) -> bool:
    return getattr(param, "pipeline_tied", False)


def is_pipeline_copy(param: nn.Parameter) -> bool:
    return getattr(param, "pipeline_copy", False)
