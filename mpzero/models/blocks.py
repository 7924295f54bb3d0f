"""The transformer's parts apart from attention (`models/attention.py`), each built from plain values so a layer
takes them as constructor arguments (Megatron-core's layer submodules, without a spec tree): the initializations
every weight is drawn with, LayerNorm (RMSNorm is `models/norms.py`) and `norm` choosing between them, the MLP with
or without a gate (GPT-2's GELU MLP, LLaMA's SwiGLU), and the hidden-state dropout.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mpzero.comm import CommGroup
from mpzero.deferred_init import deferred_parameter
from mpzero.fused import layer_norm
from mpzero.models.norms import RMSNorm
from mpzero.tensor_parallel import (ColumnParallelLinear, InitMethod, RNGStatesTracker, RowParallelLinear, copy_to_tp,
                                    mark_tensor_parallel, ones_, zeros_)


def normal_init(std: float) -> InitMethod:
    """N(0, std^2) over the full weight, from the parameter's own generator."""
    def init(full: torch.Tensor, generator: torch.Generator) -> None:
        nn.init.normal_(full, mean=0.0, std=std, generator=generator)
    return init


def vocab_rows_init(std: float, vocab: int) -> InitMethod:
    """Init of a [padded vocabulary, h] weight: only the real rows are drawn (the same draws whatever the padding
    and the TP size), the padding rows are zero (and, receiving no gradient, stay zero)."""
    def init(full: torch.Tensor, generator: torch.Generator) -> None:
        nn.init.normal_(full[:vocab], std=std, generator=generator)
        full[vocab:].zero_()
    return init


class LayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the hidden dimension (mpzero.fused.layer_norm);
    replicated across the TP group. Statistics, weight and bias are used in fp32 whatever the
    parameters' storage dtype (ZeRO stores them in bf16/fp16 under mixed precision). With `tp` given
    (sequence parallelism) it normalizes this rank's sequence slice, and the weight and bias gradients are
    all-reduced over the TP group on their way back (Megatron's allreduce of `sequence_parallel` grads)."""

    def __init__(self, hidden_size: int, eps: float, impl: str = "auto", tp: CommGroup | None = None):
        super().__init__()
        self.eps, self.impl = eps, impl
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.weight = mark_tensor_parallel(deferred_parameter((hidden_size,), ones_), None)
        self.bias = mark_tensor_parallel(deferred_parameter((hidden_size,), zeros_), None)
        self.weight.sequence_parallel = self.bias.sequence_parallel = self.tp is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight.float(), self.bias.float()
        if self.tp is not None:
            weight, bias = copy_to_tp(weight, self.tp), copy_to_tp(bias, self.tp)
        return layer_norm(x, weight, bias, self.eps, impl=self.impl)



def norm(normalization: str, hidden_size: int, eps: float, impl: str = "auto",
         tp: CommGroup | None = None) -> nn.Module:
    """--normalization's module (LayerNorm or RMSNorm), replicated across TP; `tp` under sequence parallelism."""
    return (RMSNorm if normalization == "RMSNorm" else LayerNorm)(hidden_size, eps, impl, tp)


def gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU (--openai-gelu): the tanh approximation."""
    return F.gelu(x, approximate="tanh")


class MLP(nn.Module):
    """h -> f (column-parallel, the activation on this rank's shard) -> h (row-parallel, all-reduced): GPT-2's
    fc2(gelu(fc1(x))). With `gated` (LLaMA's SwiGLU, Shazeer 2020) fc1 is one column-parallel weight [2f, h] whose
    global rows are [gate; up] (HF's gate_proj then up_proj, Megatron's linear_fc1), split in two chunks so TP rank
    r holds [gate_r; up_r], the matching halves (Megatron's fc1 stride 2; a plain split would give rank 0 two halves
    of gate, Megatron-LM#360), and the output is fc2(activation(gate) * up). Checkpoints keep the global layout,
    so they reload at any TP size. `init` draws fc1's full weight, `output_init` fc2's."""

    def __init__(self, hidden_size: int, ffn_size: int, tp: CommGroup, init: InitMethod, output_init: InitMethod, *,
                 activation: Callable[[torch.Tensor], torch.Tensor] = gelu, gated: bool = False, bias: bool = True,
                 sequence_parallel: bool = False):
        super().__init__()
        h, f, sp = hidden_size, ffn_size, sequence_parallel
        self.activation, self.gated = activation, gated
        self.fc1 = ColumnParallelLinear(h, 2 * f if gated else f, tp, init, bias=bias, sequence_parallel=sp,
                                        chunks=2 if gated else 1)
        self.fc2 = RowParallelLinear(f, h, tp, output_init, bias=bias, sequence_parallel=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = self.fc1(x).chunk(2, dim=-1)  # each [b, s, f/tp]
            return self.fc2(self.activation(gate) * up)
        return self.fc2(self.activation(self.fc1(x)))


class HiddenDropout(nn.Dropout):
    """Dropout on the hidden state: from the default generator (the same mask on every TP rank, which all hold
    the same activations) or, under sequence parallelism, from the tracker's tensor-parallel stream (each rank
    holds another slice of the sequence, as in Megatron)."""

    def __init__(self, p: float, rng: RNGStatesTracker | None, sequence_parallel: bool):
        super().__init__(p)
        self.rng, self.sequence_parallel = rng, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and self.training and self.p > 0:
            with self.rng.fork():
                return super().forward(x)
        return super().forward(x)
