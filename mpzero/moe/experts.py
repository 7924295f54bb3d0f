"""A rank's routed experts as stacked weights (Megatron's GroupedMLP, torchtitan's GroupedExperts): each expert an
MLP h -> f -> h (gated: [gate; up] rows, SwiGLU), the E_l experts of this expert-parallel rank stacked along a
first dimension, each split over the expert-tensor-parallel group like the dense MLP (fc1's rows, fc2's columns).

    weight1 [E_l, f1/etp, h]   f1 = 2f gated (the [gate; up] halves chunked per rank, as the dense MLP's), else f
    weight2 [E_l, h, f/etp]
    bias1 [E_l, f1], bias2 [E_l, h] with --add-bias-linear (Megatron allows them at expert-TP 1 only)

The tokens come sorted by local expert, `counts[e]` rows for expert e. `--moe-grouped-gemm` runs all experts in one
`torch._grouped_mm` per matrix (torchtitan's call; offsets are the counts' running sums), else a loop running each
expert's whole MLP on its rows, concatenated once (Megatron's SequentialMLP; one concatenation instead of one per
matrix took the layer from 1.06-1.15x to 1.01x an eager MoE, the experts' views taken at once to 0.9x,
bench/bench_moe.py): the two agree within fp32 rounding (tests/test_moe_experts). The `fused ops` line names which
one runs (`experts_impl`).

Initial weights are drawn expert by expert from each expert's global name, `layers.L.mlp.experts.E.weight1` (seed,
global index E = ep_rank x E_l + e): the same at every expert-parallel and expert-tensor-parallel size
(`mpzero.deferred_init.deferred_expert_parameter`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from mpzero.comm import CommGroup
from mpzero.deferred_init import deferred_expert_parameter
from mpzero.tensor_parallel import InitMethod, mark_tensor_parallel, tp_slice, zeros_

_GROUPED_MM = getattr(torch, "_grouped_mm", None)


def experts_impl(grouped_gemm: bool) -> str:
    """What runs the experts' matmuls: the grouped GEMM where asked and this torch has it, else the loop."""
    if grouped_gemm and _GROUPED_MM is not None:
        return "grouped_mm"
    return "loop" if not grouped_gemm else "loop (this torch has no torch._grouped_mm)"


class GroupedExperts(nn.Module):
    """`experts`: the global indices of this rank's experts; `etp`: the expert-tensor-parallel group."""

    def __init__(self, hidden_size: int, ffn_size: int, experts: range, etp: CommGroup, init: InitMethod,
                 output_init: InitMethod, *, activation: Callable[[torch.Tensor], torch.Tensor], gated: bool,
                 bias: bool, grouped_gemm: bool):
        super().__init__()
        h, f, t, r = hidden_size, ffn_size, etp.size, etp.rank
        f1 = 2 * f if gated else f
        chunks = 2 if gated else 1
        self.activation, self.gated, self.etp = activation, gated, etp
        self.grouped = grouped_gemm and _GROUPED_MM is not None
        self.weight1 = mark_tensor_parallel(deferred_expert_parameter(
            (f1, h), experts, init, lambda full: tp_slice(full, 0, t, r, chunks)), 1, chunks=chunks, expert=True)
        self.weight2 = mark_tensor_parallel(deferred_expert_parameter(
            (h, f), experts, output_init, lambda full: tp_slice(full, 1, t, r)), 2, expert=True)
        self.bias1 = self.bias2 = None
        if bias:  # expert-TP 1 (checks.py): whole biases
            self.bias1 = mark_tensor_parallel(deferred_expert_parameter((f1,), experts, zeros_), None, expert=True)
            self.bias2 = mark_tensor_parallel(deferred_expert_parameter((h,), experts, zeros_), None, expert=True)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [N, h] sorted by local expert, counts[e] rows each -> [N, h] (at expert-TP > 1 a partial sum over the
        expert-TP group, like a row-parallel linear's before its reduction)."""
        if not self.grouped:  # each expert's MLP on its rows, one concatenation at the end
            # each stack's experts as views taken at once: the backward stacks their gradients in one tensor, where
            # indexing expert by expert zero-fills and adds a whole stack-sized gradient per expert (E x the stack's
            # bytes written each backward: a fifth of the layer's time on a CPU at 8 experts, bench/bench_moe.py)
            stacks = [w.unbind(0) if w is not None else (None,) * len(counts)
                      for w in (self.weight1, self.bias1, self.weight2, self.bias2)]
            parts = [self._mlp(rows, *(w[e] for w in stacks)) for e, rows in enumerate(x.split(counts))]
            return torch.cat(parts) if parts else x.new_zeros(0, self.weight2.shape[1])
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        hidden = _GROUPED_MM(x, self.weight1.transpose(-2, -1), offs=offsets)
        if self.bias1 is not None:
            hidden = hidden + self._per_row(self.bias1, counts)
        out = _GROUPED_MM(self._activate(hidden), self.weight2.transpose(-2, -1), offs=offsets)
        return out + self._per_row(self.bias2, counts) if self.bias2 is not None else out

    def _mlp(self, rows: torch.Tensor, weight1: torch.Tensor, bias1: torch.Tensor | None, weight2: torch.Tensor,
             bias2: torch.Tensor | None) -> torch.Tensor:
        """One expert on its rows [n, h] -> [n, h]."""
        hidden = rows @ weight1.t()
        if bias1 is not None:
            hidden = hidden + bias1
        out = self._activate(hidden) @ weight2.t()
        return out + bias2 if bias2 is not None else out

    def _activate(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = hidden.chunk(2, dim=-1)
            return self.activation(gate) * up
        return self.activation(hidden)

    @staticmethod
    def _per_row(bias: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return bias.repeat_interleave(torch.tensor(counts, device=bias.device), dim=0, output_size=sum(counts))
