"""The micro-batches a pipeline rank holds at once, counted by the executor beside the schedule's formula: the
in-flight part of the `activation memory` line.

Counted (`HeldActivations`, updated by the executor at every compute step of a training iteration): per model chunk
the micro-batches whose forward ran and whose backward (zero bubble: I) has not, the micro-batches whose I ran and
whose W has not, and the bytes the `WeightGradStore` holds for them (the distinct storages of what its queued weight
gradients keep). Their bytes: each held micro-batch of a chunk keeps what the activation counter counted for that
chunk's first micro-batch (its layers' regions, and the regions outside the layers in the chunk that begins or ends
the model), each held-back W what the store holds; the peak over the iteration's steps.

Formula, for pipeline rank i of p, v chunks, m micro-batches:
  held   1F1B: min(p - i, m) (PipeDream-Flush: p - i - 1 warm-up forwards, then one more before the first backward);
         interleaved: Megatron's warm-up plus one, in chunk micro-batches, min(2(p - i - 1) + (v - 1)p + 1, mv)
         (all mv when m = p): on stage 0, p + (p - 1)/v stages' worth, Megatron's penalty p(1 + (p - 1)/(pv));
         ZB-H1 (m >= p): the p - i micro-batches 1F1B holds, plus the i whose W stage i holds back: p
  bytes  1F1B (p - i) M_i, with M_i a micro-batch's bytes on stage i (`ActivationFormula.micro_batch_bytes`: its
         own layers and ends, so uneven first and last stages are exact); ZB-H1 the larger of (p - i) M_i + i D_i
         (after a forward) and (p - i - 1) M_i + (i + 1) D_i (after an I, before its W: the larger where D_i > M_i,
         under full recomputation), D_i what a micro-batch's deferred weight gradients hold on stage i
         (`activations.deferred_bytes`); interleaved, whose
         held chunks change as the steady state runs, the peak over the schedule's steps of the held micro-batches
         times each chunk's bytes (`ActivationFormula.chunk_bytes`: the embedding's terms on the model's first
         chunk, the head's on its last).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from mpzero.activations import ActivationFormula, SavedBytesCounter, deferred_bytes
from mpzero.pipeline.schedules import COMM, Pipeline, Step


class HeldActivations:
    """What one training iteration of the executor holds, step by step (`moments`: after each compute step, the
    held micro-batches by chunk, the held-back W passes and the weight-gradient store's bytes)."""

    def __init__(self):
        self.reset(1)

    def reset(self, chunks: int) -> None:
        self.chunks, self.full, self.deferred = chunks, Counter(), 0
        self.moments: list[tuple[tuple[int, ...], int, int]] = []

    def step(self, kind: str, chunk: int, store_bytes: int = 0) -> None:
        if kind == "F":
            self.full[chunk] += 1
        elif kind in ("B", "I"):
            self.full[chunk] -= 1
            self.deferred += kind == "I"
        elif kind == "W":
            self.deferred -= 1
        self.moments.append((tuple(self.full[c] for c in range(self.chunks)), self.deferred, store_bytes))

    @property
    def peak(self) -> int:
        """The most forwards whose backward (zero bubble: W) had not run."""
        return max((sum(full) + deferred for full, deferred, _ in self.moments), default=0)


def schedule_moments(steps: list[Step], chunks: int) -> list[tuple[tuple[int, ...], int, int]]:
    """The moments a rank's schedule (its steps as data) passes through, without store bytes."""
    held = HeldActivations()
    held.reset(chunks)
    for step in steps:
        if step[0].kind not in COMM:
            held.step(step[0].kind, step[0].chunk)
    return held.moments


def held_formula(kind: str, pipe: Pipeline, rank: int) -> tuple[int, str]:
    """(the most micro-batches rank `rank` holds, its formula) by the schedule's closed form (module docstring)."""
    p, v, m = pipe.p, pipe.v, pipe.m
    if kind == "interleaved":
        total = m * v
        held = total if m == p else min(2 * (p - rank - 1) + (v - 1) * p + 1, total)
        return held, "mv (m = p)" if m == p else "2(p-i-1)+(v-1)p+1"
    if kind == "zb-h1":
        return min(p - rank, m) + min(rank, max(m - p + rank, 0)), "(p-i)+i"
    return min(p - rank, m), "p-i"


@dataclass(frozen=True)
class InFlightReport:
    schedule: str
    pipe: Pipeline
    rank: int
    held: int  # counted: the most forwards whose backward (W) had not run
    held_formula: int
    held_text: str
    counted: int  # bytes at the counted peak
    store: int  # of which the weight-gradient store's (zero bubble)
    formula: int | None  # None: no activation formula for the setting
    formula_text: str

    def text(self) -> str:
        pipe, unit = self.pipe, "chunk micro-batches" if self.pipe.v > 1 else "micro-batches"
        head = (f"in flight ({self.schedule}, stage {self.rank} of p {pipe.p}, v {pipe.v}, m {pipe.m}) {self.held} "
                f"{unit} counted, formula {self.held_text} = {self.held_formula}")
        if pipe.v > 1 and self.rank == 0:
            head += f" (Megatron's p(1+(p-1)/(pv)) = {pipe.p + (pipe.p - 1) / pipe.v:g} stages)"
        store = f" (weight-gradient store {self.store:,})" if self.schedule == "zb-h1" else ""
        if self.formula is None:
            return f"{head} | {self.counted:,} B counted{store}"
        ratio = f"{self.counted / self.formula:.4f}" if self.formula else "1.0000"
        return (f"{head} | {self.counted:,} B counted{store}, formula {self.formula_text} = {self.formula:,} B, "
                f"ratio {ratio}")


def counted_chunk_bytes(counter: SavedBytesCounter, stage) -> tuple[int, ...]:
    """Each chunk's counted bytes for one micro-batch: its layers' regions; what was saved outside any layer
    (embedding, head and loss, or a compiled trunk) in the chunk that begins the model, else the one that ends it."""
    layers = [sum(counter.device_bytes.get(i, 0) for i in chunk) for chunk in stage.chunks]
    outside = counter.total_bytes - sum(layers)
    layers[0 if stage.first else len(layers) - 1] += outside
    return tuple(layers)


def _peak(moments, chunk_bytes, deferred: int | None) -> int:
    """The most bytes held over `moments`: held micro-batches x their chunk's bytes, plus the held-back W passes'
    bytes (`deferred` each; None: the store's counted bytes of the moment)."""
    return max((sum(n * b for n, b in zip(full, chunk_bytes)) + (store if deferred is None else held * deferred)
                for full, held, store in moments), default=0)


def formula_bytes(kind: str, pipe: Pipeline, rank: int, steps: list[Step], formula: ActivationFormula
                  ) -> tuple[int, str]:
    """(bytes, text) of the schedule's formula for this rank (module docstring)."""
    chunk_bytes = formula.chunk_bytes
    held, _ = held_formula(kind, pipe, rank)
    if kind == "1f1b":
        return held * chunk_bytes[0], f"{held} x M {chunk_bytes[0]:,}"
    if kind == "zb-h1":  # after a forward, or after an I whose W is not yet due (where D > M: recomputation)
        d, m = deferred_bytes(formula.setting), chunk_bytes[0]
        full = min(pipe.p - rank, pipe.m)
        return (max(full * m + (held - full) * d, (full - 1) * m + (held - full + 1) * d),
                f"max({full} x M + {held - full} x D, {full - 1} x M + {held - full + 1} x D) [M {m:,}, D {d:,}]")
    shown = "/".join(f"{b:,}" for b in chunk_bytes)
    return _peak(schedule_moments(steps, pipe.v), chunk_bytes, 0), f"peak of held x M by chunk [{shown}]"


def in_flight_report(schedule, counter: SavedBytesCounter, formula: ActivationFormula | None) -> InFlightReport:
    """This rank's in-flight report after a training iteration of `schedule` (a `runner.PipelineSchedule`) whose
    first micro-batch of each chunk `counter` watched."""
    run, kind, rank = schedule.run, schedule.kind, schedule.rank
    held = run.held
    counted_chunks = counted_chunk_bytes(counter, run.model.stage)
    counted = max(held.moments, key=lambda moment: _peak([moment], counted_chunks, None), default=((0,), 0, 0))
    number, text = held_formula(kind, run.pipe, rank)
    value, value_text = (None, "") if formula is None else formula_bytes(kind, run.pipe, rank,
                                                                         schedule.train_steps, formula)
    return InFlightReport(kind, run.pipe, rank, held.peak, number, text, _peak([counted], counted_chunks, None),
                          counted[2], value, value_text)
