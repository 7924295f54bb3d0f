"""Megatron's tensor-parallel layers: column- and row-parallel linears and the vocab-parallel embedding.

Initialization is TP-invariant and deferred (`mpzero.deferred_init`): every parameter is created without
storage, with its recipe: the FULL weight's shape, its fill and how this rank's slice is cut; when it is made,
every rank draws the full weight from the parameter's own generator and keeps its slice, so a model at TP=2 starts
from exactly the weights it has at TP=1. `init_method(full, generator)` fills the full fp32 weight in place. A layer
built alone is made with `name_parameters(layer, seed)` and `materialize_module(layer, device)` (GPTModel does both
unless built with device "meta", which leaves it to ZeroOptimizer).
Every parameter is marked with how it is split (`placement.mark_tensor_parallel`), so gradient norms,
checkpoints and export can gather or reshard it generically.

Sequence parallelism (`sequence_parallel=True`, Megatron's SP): the column-parallel input arrives as this
rank's 1/t slice of the sequence and is all-gathered along it (`linear_with_sequence_gather`: only the slice
is kept for backward, the whole input gathered again there, as Megatron's
LinearWithGradAccumulationAndAsyncCommunication); the row-parallel output is reduce-scattered along the
sequence instead of all-reduced, and its replicated bias, added to a slice, has its gradient all-reduced over
the TP group (`copy_to_tp` on the parameter), so every rank holds the same bias gradient.

FP8 (`use_fp8`, fp8.py): a column- or row-parallel linear runs its matmul through torchao's float8 casts with scales
taken over the whole TP group; the region crossings and the bias stay as they are.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from mpzero.comm import CommGroup
from mpzero.deferred_init import Fill, deferred_parameter
from mpzero.errors import ConfigError
from mpzero.tensor_parallel.fp8 import FP8_MULTIPLE, Fp8Linear, Fp8Recipe
from mpzero.tensor_parallel.mappings import (copy_to_tp, gather_from_tp, gather_sequence, reduce_from_tp,
                                             reduce_scatter_sequence, reduce_scatter_to_sequence_parallel,
                                             scatter_to_tp)
from mpzero.tensor_parallel.placement import mark_tensor_parallel, tp_slice, tp_unslice
from mpzero.tensor_parallel.weight_grad import WeightGradStore, deferring_linear, sequence_weight_grad

InitMethod = Fill  # (full fp32 weight, its generator) -> None, in place


def sharded_parameter(full_shape: tuple[int, ...], partition_dim: int, group: CommGroup,
                      init_method: InitMethod, chunks: int = 1) -> nn.Parameter:
    """A deferred parameter: this rank's part of a full weight of `full_shape`, drawn identically on every rank
    whatever the TP size; `chunks` > 1: the full weight is that many blocks along `partition_dim` (SwiGLU's
    [gate; up]) and the part is this rank's slice of each (`tp_slice`)."""
    shard = partial(tp_slice, partition_dim=partition_dim, tp_size=group.size, tp_rank=group.rank, chunks=chunks)
    return mark_tensor_parallel(deferred_parameter(full_shape, init_method, shard), partition_dim, chunks=chunks)


def zeros_(full: torch.Tensor, generator: torch.Generator) -> None:
    full.zero_()


def ones_(full: torch.Tensor, generator: torch.Generator) -> None:
    full.fill_(1.0)


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts != 0:
        raise ConfigError(f"{what} {total} is not divisible by --tensor-model-parallel-size {parts}")
    return total // parts


def _bias(size: int, partition_dim: int | None, chunks: int = 1) -> nn.Parameter:
    return mark_tensor_parallel(deferred_parameter((size,), zeros_), partition_dim, chunks=chunks)


def _fp8_linear(layer: nn.Module, recipe: Fp8Recipe, kind: str, local: tuple[int, int]) -> Fp8Linear:
    """The layer's FP8 matmul; one ConfigError line when this rank's weight [out, in] is not float8-sized."""
    if local[0] % FP8_MULTIPLE or local[1] % FP8_MULTIPLE:
        raise ConfigError(f"FP8: a {kind}-parallel weight [{layer.out_features}, {layer.in_features}] is "
                          f"{list(local)} on each of {layer.group.size} TP ranks, not multiples of {FP8_MULTIPLE} as "
                          f"FP8 matmuls need: choose sizes divisible by {FP8_MULTIPLE} x the TP size, or another "
                          f"--tensor-model-parallel-size")
    return Fp8Linear(recipe, layer.group, kind, gather_sequence=kind == "column" and layer.sequence_parallel)


class _LinearWithSequenceGather(torch.autograd.Function):
    """y = gather_seq(x) W^T + b for x [b, s/t, in], this rank's sequence slice: keeps the slice, not the
    gathered input, for backward, where it gathers it again for the weight gradient and reduce-scatters the
    input gradient along the sequence."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, store):
        ctx.group, ctx.has_bias, ctx.store = group, bias is not None, store
        ctx.save_for_backward(x, weight)
        return F.linear(gather_sequence(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_input = reduce_scatter_sequence(grad.matmul(weight), ctx.group)
        grad_bias = grad.reshape(-1, grad.size(-1)).sum(0) if ctx.has_bias else None
        if ctx.store is not None and ctx.store.deferring is not None:  # zero bubble's W pass gathers x again
            ctx.store.put(lambda: sequence_weight_grad(x, grad, ctx.group, gather_sequence), weight, (x, grad))
            return grad_input, None, grad_bias, None, None
        return grad_input, sequence_weight_grad(x, grad, ctx.group, gather_sequence), grad_bias, None, None


def linear_with_sequence_gather(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                group: CommGroup, store: WeightGradStore | None = None) -> torch.Tensor:
    """F.linear over the whole sequence from this rank's slice x [b, s/t, in] (sequence parallelism). `store`:
    zero bubble's split backward may defer the weight gradient (weight_grad.py)."""
    if group.size == 1:
        return _linear(x, weight, bias, store)
    return _LinearWithSequenceGather.apply(x, weight, bias, group, store)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            store: WeightGradStore | None) -> torch.Tensor:
    """F.linear, or with a store (zero bubble) the linear whose weight gradient the store may defer."""
    return F.linear(x, weight, bias) if store is None else deferring_linear(x, weight, bias, store)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's rows (output features) split across the TP group; y stays sharded
    unless `gather_output` (`chunks` > 1: W is that many row blocks, each split across TP, see `TensorPlacement`).
    The input is replicated, so its gradient is all-reduced on the way back
    (with `sequence_parallel` the input is this rank's sequence slice, gathered; its gradient reduce-scattered).
    `weight_grad_store` (set by a zero-bubble pipeline): the weight gradient may be deferred (weight_grad.py)."""

    weight_grad_store: WeightGradStore | None = None

    def __init__(self, in_features: int, out_features: int, group: CommGroup, init_method: InitMethod,
                 bias: bool = True, gather_output: bool = False, sequence_parallel: bool = False,
                 chunks: int = 1):
        super().__init__()
        if gather_output and chunks != 1:
            raise ConfigError("ColumnParallelLinear: gather_output would concatenate [gate_r; up_r] blocks rank by "
                              "rank, not the global [gate; up]: use chunks 1 with gather_output")
        self.group, self.gather_output = group, gather_output
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel = sequence_parallel and group.size > 1
        local_out = _divide(out_features, group.size * chunks, "output size") * chunks
        self.weight = sharded_parameter((out_features, in_features), 0, group, init_method, chunks)
        self.bias = _bias(local_out, 0, chunks) if bias else None
        self.fp8: Fp8Linear | None = None
        self.gathered_weight = None  # ZeRO-3's float8 weight (--fp8-param-gather: zero/fp8_gather.py)

    def use_fp8(self, recipe: Fp8Recipe) -> None:
        """Run the matmul in FP8 (fp8.py): the weight's scale is its whole weight's, over the TP group."""
        self.fp8 = _fp8_linear(self, recipe, "column", (self.out_features // self.group.size, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        store = self.weight_grad_store
        if self.fp8 is not None:  # the sequence gather (or copy_to_tp) around torchao's casts and GEMMs
            y = self.fp8(x if self.sequence_parallel else copy_to_tp(x, self.group), self.weight,
                         self.gathered_weight)
            y = y + self.bias.to(y.dtype) if self.bias is not None else y
        elif self.sequence_parallel:
            y = linear_with_sequence_gather(x, self.weight, self.bias, self.group, store)  # [b, s, out/tp]
        else:
            y = _linear(copy_to_tp(x, self.group), self.weight, self.bias, store)  # [..., out/tp]
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's columns (input features) split across the TP group: each rank computes a
    partial product from its input shard, the partials are all-reduced, then the replicated bias is added.
    `weight_grad_store`: as ColumnParallelLinear's."""

    weight_grad_store: WeightGradStore | None = None

    def __init__(self, in_features: int, out_features: int, group: CommGroup, init_method: InitMethod,
                 bias: bool = True, input_is_parallel: bool = True, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel = sequence_parallel and group.size > 1
        _divide(in_features, group.size, "input size")
        self.fp8: Fp8Linear | None = None
        self.gathered_weight = None  # ZeRO-3's float8 weight (--fp8-param-gather: zero/fp8_gather.py)
        self.weight = sharded_parameter((out_features, in_features), 1, group, init_method)
        self.bias = _bias(out_features, None) if bias else None
        if self.bias is not None:
            self.bias.sequence_parallel = self.sequence_parallel  # Megatron's mark: gradient all-reduced over TP

    def use_fp8(self, recipe: Fp8Recipe) -> None:
        """Run the matmul in FP8 (fp8.py): the input's and weight's scales are the whole tensors', over TP."""
        self.fp8 = _fp8_linear(self, recipe, "row", (self.out_features, self.in_features // self.group.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        partial = (self.fp8(x, self.weight, self.gathered_weight) if self.fp8 is not None
                   else _linear(x, self.weight, None, self.weight_grad_store))
        if self.sequence_parallel:  # [b, s, in/tp] -> this rank's summed sequence slice [b, s/tp, out]
            y = reduce_scatter_to_sequence_parallel(partial, self.group)
            return y + copy_to_tp(self.bias, self.group) if self.bias is not None else y
        y = reduce_from_tp(partial, self.group)  # [..., out], full sum
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table [vocab, h] with its rows split across the TP group: rank r owns ids
    [r*V/tp, (r+1)*V/tp); ids elsewhere look up zeros here and the all-reduce fills them in."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: CommGroup, init_method: InitMethod):
        super().__init__()
        self.group = group
        self.num_local = _divide(num_embeddings, group.size, "padded vocabulary size")
        self.vocab_start = group.rank * self.num_local
        self.weight = sharded_parameter((num_embeddings, embedding_dim), 0, group, init_method)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)


def gather_full(tensor: torch.Tensor, partition_dim: int | None, group: CommGroup, chunks: int = 1) -> torch.Tensor:
    """The unsharded tensor from every TP rank's shard (for export, checks and checkpoint conversion)."""
    if partition_dim is None or group.size == 1:
        return tensor.detach().clone()
    gathered = group.all_gather_cat(tensor.detach(), dim=partition_dim)
    if chunks == 1:
        return gathered
    return tp_unslice(list(gathered.chunk(group.size, dim=partition_dim)), partition_dim, chunks)
