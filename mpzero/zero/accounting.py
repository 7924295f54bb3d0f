"""Counted model-state memory and communication beside the ZeRO paper's formulas.

Memory (per rank): P trainable parameters, N DP ranks, p / g bytes per parameter / gradient element,
K = 8 (Adam's fp32 moments) + 4 when fp32 master weights are kept apart from the parameters
(mixed precision). Stage 0: (p+g+K)P; stage 1: (p+g)P + KP/N; stage 2: pP + (g+K)P/N; stage 3:
(p+g+K)P/N. fp16 gives the paper's 16P, 4P+12P/N, 2P+14P/N, 16P/N; bf16 (fp32 gradients) 18P, ...
The measured side sums the unique storages this rank holds, padding included.

Communication per iteration (per rank, ring model, m micro-batches): stage 0 all-reduces gradients,
2gP(N-1)/N; stage 1 reduce-scatters gradients once and all-gathers parameters, (g+p)P(N-1)/N;
stage 2 reduce-scatters every micro-batch, (m g + p)P(N-1)/N; stage 3 gathers every unit (the root
included) for forward and again for backward and reduce-scatters gradients, every micro-batch,
m(2p + g)P(N-1)/N. With g = p these are the paper's 2P and 3P (times N-1/N).

Stage 3's in-step peak: the shards (the formula above) plus the working set its schedule keeps gathered or
in flight (Stage3.peak_working_set), counted by a meter as the buffers are created and freed.

Both report lines are `|`-separated "name value" fields whose value has no spaces:
`dict(f.strip().rsplit(" ", 1) for f in line.split("|")[1:])` parses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PeakReport:
    """The high-water mark inside a step: the shards plus the transient buffers counted at that moment."""
    measured: int
    formula: float
    formula_text: str

    @property
    def ratio(self) -> float:
        return self.measured / self.formula


@dataclass(frozen=True)
class MemoryReport:
    stage: int
    dp_size: int
    numel: int  # trainable parameters P (this TP rank's)
    measured: int  # bytes of unique storages held
    formula: float
    formula_text: str
    padding: int  # padding elements across all flat buffers
    peak: PeakReport | None = None  # stage 3, once a step has run

    @property
    def ratio(self) -> float:
        return self.measured / self.formula

    def line(self) -> str:
        peak = "" if self.peak is None else (
            f" | peak bytes {self.peak.measured} | peak formula {self.peak.formula_text} | peak formula bytes "
            f"{self.peak.formula:.0f} | peak ratio {self.peak.ratio:.4f}")
        return (f"zero memory | stage {self.stage} | dp {self.dp_size} | params {self.numel} | "
                f"measured bytes {self.measured} | formula {self.formula_text} | formula bytes {self.formula:.0f} | "
                f"ratio {self.ratio:.4f} | padding elements {self.padding}{peak}")


@dataclass(frozen=True)
class CommReport:
    stage: int
    dp_size: int
    micro_batches: int
    measured: float  # bytes per rank per iteration, counted by CommGroup
    theory: float
    theory_text: str

    @property
    def ratio(self) -> float:
        if self.theory == 0:
            return 1.0 if self.measured == 0 else float("inf")
        return self.measured / self.theory

    def line(self) -> str:
        return (f"zero comm | stage {self.stage} | dp {self.dp_size} | micro-batches {self.micro_batches} | "
                f"measured bytes/iter {self.measured:.0f} | theory {self.theory_text} | theory bytes/iter {self.theory:.0f} | "
                f"ratio {self.ratio:.4f}")


def unique_storage_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def memory_formula(stage: int, p: int, g: int, master: int) -> tuple[int, int]:
    """(replicated, partitioned) bytes per parameter: total = replicated*P + partitioned*P/N."""
    k = master + 8
    return {0: (p + g + k, 0), 1: (p + g, k), 2: (p, g + k), 3: (0, p + g + k)}[stage]


def formula_text(terms: list[tuple[int, str]]) -> str:
    return "+".join(f"{coef}{symbol}" for coef, symbol in terms if coef) or "0"


def memory_report(stage: int, dp_size: int, numel: int, measured: int, padding: int,
                  p: int, g: int, master: int) -> MemoryReport:
    replicated, partitioned = memory_formula(stage, p, g, master)
    formula = numel * (replicated + partitioned / dp_size)
    text = formula_text([(replicated, "P"), (partitioned, "P/N")])
    return MemoryReport(stage, dp_size, numel, measured, formula, text, padding)


def comm_theory(stage: int, dp_size: int, numel: int, p: int, g: int, micro_batches: int) -> tuple[float, str]:
    """(bytes per rank per iteration, formula) for P = numel, m = micro_batches."""
    m = micro_batches
    coef = {0: 2 * g, 1: g + p, 2: m * g + p, 3: m * (2 * p + g)}[stage]
    return coef * numel * (dp_size - 1) / dp_size, f"({formula_text([(coef, 'P')])})(N-1)/N"
