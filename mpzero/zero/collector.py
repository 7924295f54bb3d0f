"""Gradients leave `param.grad` for flat buffers as autograd produces them (`GradCollector`).

Every parameter's post-accumulate-grad hook adds the fresh gradient into the parameter's place in its bucket's flat
buffer (upcast to the buffer's dtype: bf16 gradients accumulate in fp32) and drops `param.grad`, so autograd's copy
lives only until its hook runs.
Where the buffers persist (`persistent`, stages 0-1), each parameter's place in its buffer is kept as a view in
the parameter's shape (made at its first delivery: no slicing or reshaping per delivery), and 1-D parameters
(biases, norm weights) lie side by side in a bucket (`flat.build_layout` puts the weight-decay-free ones last):
their gradients are held until the last of their run arrives, then added with one concatenation and one add
(`VectorRun`). A GPU otherwise launches one kernel per parameter, 98 of GPT-2 124M's 148, each a few thousand
elements; the values and the order of the additions are the same, so the buffers are bitwise the same.
No buffer is zeroed before gradients go into it: a parameter's first gradient in a buffer is copied over the
place's stale values (persistent buffers after a step, `overwrite_next`; a bucket's full buffer, made
uninitialised, `fresh`), later ones are added, and the places of parameters that received none are zeroed before
their bucket is reduced (persistent: when the backward ends, `flush`; full buffers: `zero_unwritten`). A GPU then
makes no pass over the buffers to zero them and the first add does not read them: for GPT-2 124M's fp32
gradients, 0.5 GB written and 0.5 GB read less a step (and at stages 2-3 a micro-batch). The values are those of
zeroing and adding (x, where 0 + x gives +0.0 for a -0.0, which no step tells apart).
A bucket is reported ready once every parameter in it has delivered; this also holds under reentrant activation
checkpointing, where the hooks fire inside the recomputation's inner backward. A parameter that delivers again after
its bucket was reported (used in two reentrant regions) is recorded as late. The reductions are grads.py's.
The hooks run once per parameter per backward, on the host time a launch-bound GPU step waits for: their
bookkeeping is by parameter index in lists (a tensor key hashes through a Python call) and each parameter's hook is
bound to its index.
Where a compiled backward delivers a bucket's gradients together (`write_together`: the model's backward is one
compiled region, whose gradients all exist at once anyway), each is held until its bucket is complete and the bucket
is written with one `_foreach_copy_` (casts included) and one `_foreach_add_`: on a GPU a few launches per bucket
instead of one per parameter (GPT-2 124M's bf16 step: 53 cast-copies), the same elementwise arithmetic, so the
buffers are bitwise the same. An eager backward writes as it goes: holding its gradients would keep them alive.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from mpzero.zero.flat import FlatLayout


class GradCollector:
    def __init__(self, layouts: list[FlatLayout], buffer_of: Callable[[int], torch.Tensor],
                 on_ready: Callable[[int], None], persistent: bool):
        """persistent: `buffer_of` returns the same buffers for the collector's lifetime (stages 0-1, made with
        zeros): parameters' places are cached as views and 1-D parameters delivered by runs (`VectorRun`).
        Otherwise (stages 2-3) `buffer_of` makes a bucket's full buffer at its first delivery, uninitialised, and
        calls `fresh(bucket)`; the in-step peak replays when."""
        self._buffer_of, self._on_ready = buffer_of, on_ready
        self._bucket, self._start, self._end, self._shape, self._run_of = [], [], [], [], []  # by parameter index
        self._sizes, self._first = [], []  # per bucket: its parameters, and the index of its first one
        self._persistent = persistent
        self._runs: list[tuple[VectorRun, tuple[int, ...]]] = []  # a run and its members' indices
        for b, layout in enumerate(layouts):
            first = len(self._bucket)
            self._first.append(first)
            for offset, shape in zip(layout.offsets, layout.shapes):
                self._bucket.append(b)
                self._start.append(offset)
                self._end.append(offset + shape.numel())
                self._shape.append(shape)
                self._run_of.append(None)
            for run in vector_runs(layout, b) if persistent else ():
                members = tuple(first + j for j in run.indices)
                for i in members:
                    self._run_of[i] = len(self._runs)
                self._runs.append((run, members))
            self._sizes.append(len(layout.params))
        self._views: list[torch.Tensor | None] = [None] * len(self._bucket)  # persistent: each one's place, shaped
        # Per parameter: its place holds a gradient of this step (else stale values, overwritten by the next one);
        # per bucket: how many do not.
        self._written = [persistent] * len(self._bucket)
        self._unwritten = [0 if persistent else size for size in self._sizes]
        params = [p for layout in layouts for p in layout.params]
        self._hooks = [p.register_post_accumulate_grad_hook(partial(self._deliver, i)) for i, p in enumerate(params)]
        self._params = params
        self._together = [False] * len(params)  # `write_together`
        self.together = False
        self.reset()

    def write_together(self, params: set) -> None:
        """Hold the gradients of `params` (those a compiled backward delivers together) until all of a bucket's
        have arrived, and write them with one foreach copy and add (see the module docstring)."""
        self._together = [p in params for p in self._params]  # a tensor hashes by identity
        self.together = any(self._together)
        self.reset()

    def overwrite_next(self) -> None:
        """The persistent buffers' values are stale (a step used them): the next backward writes each parameter's
        first gradient instead of adding it, and zeroes the places of parameters that receive none."""
        if not self._persistent:
            raise RuntimeError("only persistent buffers are overwritten: a bucket's full buffer is made anew")
        self._written = [False] * len(self._bucket)
        self._unwritten = list(self._sizes)

    def fresh(self, bucket: int) -> None:
        """`bucket`'s buffer was just made, uninitialised (stages 2-3): no place in it holds a gradient."""
        first = self._first[bucket]
        self._written[first:first + self._sizes[bucket]] = [False] * self._sizes[bucket]
        self._unwritten[bucket] = self._sizes[bucket]

    def zero_unwritten(self, bucket: int) -> None:
        """Zeroes the places in `bucket`'s buffer that hold no gradient of this step: before it is reduced."""
        if not self._unwritten[bucket]:
            return
        first = self._first[bucket]
        for i in range(first, first + self._sizes[bucket]):
            if not self._written[i]:
                self._place(i).zero_()
                self._written[i] = True
        self._unwritten[bucket] = 0

    def reset(self) -> None:
        n = len(self._bucket)
        self._waiting = list(self._sizes)  # per bucket: parameters that have not delivered in this backward
        self._delivered = [False] * n
        self._held: list[torch.Tensor | None] = [None] * n  # a run member's gradient, waiting for the rest of its run
        self._arrived = [False] * n  # run members whose first gradient of this backward arrived
        self._unheld = [len(members) for _, members in self._runs]  # per run: members not yet arrived
        self._waiting_writes = [sum(self._together[f:f + n]) for f, n in zip(self._first, self._sizes)]  # to hold
        self.late: set[int] = set()

    def _deliver(self, i: int, param: torch.Tensor) -> None:
        grad, param.grad = param.grad, None
        if grad is None:  # its accumulator ran without a gradient (zero bubble's deferred weight gradient)
            return
        bucket, run = self._bucket[i], self._run_of[i]
        if self._together[i] and not self._delivered[i] and self._held[i] is None and self._waiting[bucket]:
            self._held[i] = grad
            self._waiting_writes[bucket] -= 1
            if not self._waiting_writes[bucket]:
                self._mark_delivered(bucket, self._write_bucket(bucket))
            return
        if run is not None and not self._arrived[i] and self._waiting[bucket]:
            self._arrived[i] = True
            self._held[i] = grad
            self._unheld[run] -= 1
            if not self._unheld[run]:
                self._mark_delivered(bucket, self._fold(run))
            return
        # One parameter: a matrix, or a late or repeated gradient (added after the one held, in that order)
        target = self._place(i)  # (a full buffer made here is `fresh` before its first write)
        held = self._take(i)
        if held is not None:
            self._write((i,), target, held)
        self._write((i,), target, grad)
        self._mark_delivered(bucket, (i,))

    def _write(self, indices, place: torch.Tensor, values: torch.Tensor) -> None:
        """The gradients of parameters `indices` (of one bucket, all written this step or none: one parameter, or a
        run) into their place: copied (and cast) over stale values, else added."""
        if self._written[indices[0]]:
            place.add_(values)
            return
        place.copy_(values)
        for i in indices:
            self._written[i] = True
        self._unwritten[self._bucket[indices[0]]] -= len(indices)

    def _write_bucket(self, bucket: int) -> list[int]:
        """The bucket's held gradients into their places with one foreach copy (over stale values) and one foreach
        add; returns their indices."""
        first = self._first[bucket]
        held = [i for i in range(first, first + self._sizes[bucket])
                if self._together[i] and self._held[i] is not None]
        places = {i: self._place(i) for i in held}  # first: a full buffer made here is `fresh` before the writes
        fresh, again = [i for i in held if not self._written[i]], [i for i in held if self._written[i]]
        for indices, write in ((fresh, torch._foreach_copy_), (again, torch._foreach_add_)):
            if indices:
                write([places[i] for i in indices], [self._take(i) for i in indices])
        for i in fresh:
            self._written[i] = True
        self._unwritten[bucket] -= len(fresh)
        return held

    def _place(self, i: int) -> torch.Tensor:
        """Parameter i's place in its bucket's buffer, in its shape."""
        place = self._views[i]
        if place is None:
            place = self._buffer_of(self._bucket[i])[self._start[i]:self._end[i]].view(self._shape[i])
            if self._persistent:
                self._views[i] = place
        return place

    def _fold(self, run: int) -> list[int]:
        """The run's held gradients into its region of the flat buffer, returning their indices: all of them
        with one concatenation and one add (a GPU launches 2 kernels, not one per parameter); if a member was
        delivered on its own (a repeated gradient), the others one by one."""
        vector_run, members = self._runs[run]
        flat, held = self._buffer_of(vector_run.bucket), [i for i in members if self._held[i] is not None]
        if len(held) == len(members):  # none delivered on its own: all written (flush) or none (overwrite_next)
            self._write(held, flat[vector_run.start:vector_run.end],
                        torch.cat([self._take(i).reshape(-1) for i in held]))
            return held
        for i in held:
            self._write((i,), self._place(i), self._take(i))
        return held

    def _take(self, i: int) -> torch.Tensor | None:
        grad, self._held[i] = self._held[i], None
        return grad

    def _mark_delivered(self, bucket: int, indices) -> None:
        if not self._waiting[bucket]:
            self.late.add(bucket)
            return
        for i in indices:
            if not self._delivered[i]:
                self._delivered[i] = True
                self._waiting[bucket] -= 1
        if not self._waiting[bucket]:
            self._on_ready(bucket)

    def flush(self) -> None:
        """End of backward: gradients still held (a run with a member that received none) go into their buffers;
        the persistent buffers' places that received no gradient since `overwrite_next` are zeroed."""
        for bucket in range(len(self._sizes)) if self.together else ():
            if self._waiting_writes[bucket] and self._waiting[bucket]:  # one of them received no gradient
                self._mark_delivered(bucket, self._write_bucket(bucket))
        for run, (vector_run, members) in enumerate(self._runs):
            if any(self._held[i] is not None for i in members):
                self._mark_delivered(vector_run.bucket, self._fold(run))
        if self._persistent:
            for bucket in range(len(self._sizes)):
                self.zero_unwritten(bucket)


@dataclass(frozen=True, eq=False)
class VectorRun:
    """Consecutive 1-D parameters of a bucket (biases, norm weights: weight-decay-free parameters lie side by side,
    `flat.build_layout`): elements [start, end) of the bucket's flat buffer."""
    bucket: int
    params: tuple[torch.Tensor, ...]
    indices: tuple[int, ...]  # the params' places in the layout
    start: int
    end: int


def vector_runs(layout: FlatLayout, bucket: int) -> list[VectorRun]:
    """The layout's maximal runs of two or more adjacent 1-D parameters. Their gradients are small (a few times the
    hidden size per layer) and many (8 of a GPT-2 layer's 12 parameters): `GradCollector` holds them until the run
    is complete and adds them in one pass."""
    runs, current = [], []
    for i, param in enumerate(layout.params + (None,)):
        if param is not None and param.dim() == 1:
            current.append(i)
            continue
        if len(current) >= 2:
            first, last = current[0], current[-1]
            runs.append(VectorRun(bucket, tuple(layout.params[j] for j in current), tuple(current),
                                  layout.offsets[first], layout.offsets[last] + layout.shapes[last].numel()))
        current = []
    return runs
