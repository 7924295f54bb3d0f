"""What a pipeline rank sends per iteration and holds at once, counted beside the schedule's formulas.

Point-to-point bytes per rank per iteration (the `pipeline comm` line): each micro-batch's activation
A = b s' h p bytes (s' = s/t under sequence parallelism, p the model dtype's bytes) goes forward from every virtual
stage but the model's last, and its gradient back from every one but the first: (F + B) m A for a rank whose v
chunks hold F stages that send forward and B that send back (1F1B: F = 1 unless the last stage, B = 1 unless the
first; interleaved: v times as many, less the model's ends). With GPT-2's tied embedding the first and last stage
also all-reduce its gradient slice of S bytes once per iteration: 2S(N-1)/N = S for the pair.

Micro-batches held at once (the `activation memory` line's in-flight count), counted by the executor as the forwards
whose backward has not run (zero bubble: whose W has not run) against the schedule's own count (the simulation of
its steps: 1F1B p - r on stage r, interleaved Megatron's (1 + (p - 1)/(p v)) p in whole stages, ZB-H1 p).
"""

from __future__ import annotations

from dataclasses import dataclass

from mpzero.comm import CommGroup
from mpzero.pipeline.schedules import Pipeline, Step
from mpzero.pipeline.simulate import simulate
from mpzero.zero.accounting import counted_ratio


@dataclass(frozen=True)
class PipelineCommReport:
    stage: int
    schedule: str
    pipe: Pipeline
    measured: float  # bytes per iteration sent on the pipeline and embedding groups
    theory: float
    theory_text: str

    @property
    def ratio(self) -> float:
        return counted_ratio(self.measured, self.theory)

    def line(self) -> str:
        pipe = self.pipe
        return (f"pipeline comm | stage {self.stage} | schedule {self.schedule} | p {pipe.p} | v {pipe.v} | "
                f"micro-batches {pipe.m} | measured bytes/iter {self.measured:.0f} | theory {self.theory_text} | "
                f"theory bytes/iter {self.theory:.0f} | ratio {self.ratio:.4f}")


def p2p_theory(pipe: Pipeline, rank: int, activation_bytes: int, tied_bytes: int = 0,
               tied_ranks: int = 1) -> tuple[float, str]:
    """(bytes per iteration, formula) this rank sends: activations and gradients, and the tied embedding's
    all-reduce (ring model) over its `tied_ranks` holders."""
    forward = sum(1 for chunk in range(pipe.v) if not pipe.is_last(rank, chunk))
    backward = sum(1 for chunk in range(pipe.v) if not pipe.is_first(rank, chunk))
    total = (forward + backward) * pipe.m * activation_bytes
    text = f"({forward}+{backward})mA"
    if tied_bytes:
        total += 2 * tied_bytes * (tied_ranks - 1) / tied_ranks
        text += "+2S(N-1)/N"
    return total, f"{text}[A={activation_bytes},S={tied_bytes}]" if tied_bytes else f"{text}[A={activation_bytes}]"


def schedule_in_flight(pipe: Pipeline, schedule: list[list[Step]]) -> tuple[int, ...]:
    """Each rank's most (chunk, micro-batch) activations held at once, by the schedule (its simulation)."""
    return simulate(pipe, schedule).in_flight


class PipelineMeter:
    """The bytes this rank sends on the pipeline group (activations and gradients) and the tied embedding's
    all-reduce, per iteration since the last report (the loss's all-reduce over the stages is bookkeeping, not
    counted); `uncounted` leaves an evaluation's sends out."""

    def __init__(self, pp: CommGroup, embedding: CommGroup, schedule: str, pipe: Pipeline, rank: int,
                 activation_bytes: int, tied_bytes: int):
        self.pp, self.embedding, self.schedule, self.pipe, self.rank = pp, embedding, schedule, pipe, rank
        self.theory = p2p_theory(pipe, rank, activation_bytes, tied_bytes, embedding.size)
        self._mark = (self._sent(), 0)

    def _sent(self) -> float:
        return self.pp.stats.bytes.get("send", 0.0) + self.embedding.stats.bytes.get("all_reduce", 0.0)

    def uncounted(self, fn, *args):
        before = self._sent()
        result = fn(*args)
        mark, iteration = self._mark
        self._mark = (mark + self._sent() - before, iteration)
        return result

    def report(self, iteration: int) -> PipelineCommReport:
        (mark, since), now = self._mark, self._sent()
        self._mark = (now, iteration)
        measured = (now - mark) / max(iteration - since, 1)
        return PipelineCommReport(self.rank, self.schedule, self.pipe, measured, *self.theory)
