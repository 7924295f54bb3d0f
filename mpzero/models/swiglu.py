"""LLaMA's gated MLP (Shazeer 2020's SwiGLU): down(silu(gate(x)) * up(x)), under tensor parallelism."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from mpzero.comm import CommGroup
from mpzero.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from mpzero.tensor_parallel.layers import InitMethod

if TYPE_CHECKING:
    from mpzero.models.gpt import GPTConfig


class SwiGLUMLP(nn.Module):
    """h -> [gate; up] (one column-parallel weight [2f, h]) -> silu(gate) * up [f/tp] -> h (row-parallel).
    The fused weight's global rows are [gate; up] (HF's gate_proj then up_proj, Megatron's linear_fc1), split in
    two chunks so TP rank r holds [gate_r; up_r]: the matching halves, and the local output splits in two
    (Megatron's fc1 stride 2; a plain split would give rank 0 two halves of gate, Megatron-LM#360). Checkpoints
    keep the global [gate; up] layout, so they reload at any TP size. `init` draws the full [2f, h] weight,
    `output_init` the [h, f] down projection."""

    def __init__(self, config: GPTConfig, tp: CommGroup, init: InitMethod, output_init: InitMethod):
        super().__init__()
        h, f, sp, bias = config.hidden_size, config.ffn_size, config.sequence_parallel, config.add_bias_linear
        self.fc1 = ColumnParallelLinear(h, 2 * f, tp, init, bias=bias, sequence_parallel=sp, chunks=2)
        self.fc2 = RowParallelLinear(f, h, tp, output_init, bias=bias, sequence_parallel=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc1(x).chunk(2, dim=-1)  # each [b, s, f/tp]
        return self.fc2(F.silu(gate) * up)
