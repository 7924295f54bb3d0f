"""Gradients leave `param.grad` for flat buffers as autograd produces them (`GradCollector`).

Every parameter's post-accumulate-grad hook adds the fresh gradient into the parameter's place in its bucket's flat
buffer (upcast to the buffer's dtype: bf16 gradients accumulate in fp32) and drops `param.grad`, so autograd's copy
lives only until its hook runs.
With `hold_runs` (stages 0-1), 1-D parameters (biases, norm weights) lie side by side in a bucket (`flat.build_layout`
puts the weight-decay-free ones last): their gradients are held until the last of their run arrives, then added with
one concatenation and one add (`VectorRun`). A GPU otherwise launches one kernel per parameter, 98 of GPT-2 124M's
148, each a few thousand elements; the values and the order of the additions are the same, so the buffers are
bitwise the same.
A bucket is reported ready once every parameter in it has delivered; this also holds under reentrant activation
checkpointing, where the hooks fire inside the recomputation's inner backward. A parameter that delivers again after
its bucket was reported (used in two reentrant regions) is recorded as late. The reductions are grads.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from mpzero.zero.flat import FlatLayout


class GradCollector:
    def __init__(self, layouts: list[FlatLayout], buffer_of: Callable[[int], torch.Tensor],
                 on_ready: Callable[[int], None], hold_runs: bool):
        """hold_runs: deliver 1-D parameters by runs (`VectorRun`); only where the buffers persist (stages 0-1):
        at stages 2-3 a bucket's full buffer is made at its first delivery, and the in-step peak replays when."""
        self._buffer_of, self._on_ready = buffer_of, on_ready
        self._place = {}  # param -> (bucket, offset, numel)
        self._runs: list[VectorRun] = []
        self._run_of: dict[torch.Tensor, VectorRun] = {}
        for b, layout in enumerate(layouts):
            for param, offset, shape in zip(layout.params, layout.offsets, layout.shapes):
                self._place[param] = (b, offset, shape.numel())
            for run in vector_runs(layout, b) if hold_runs else ():
                self._runs.append(run)
                self._run_of.update(dict.fromkeys(run.params, run))
        self._members = [set(layout.params) for layout in layouts]
        self._hooks = [p.register_post_accumulate_grad_hook(self._deliver) for p in self._place]
        self.reset()

    def reset(self) -> None:
        self._waiting = [set(members) for members in self._members]
        self._held: dict[torch.Tensor, torch.Tensor] = {}  # param -> its gradient, waiting for the rest of its run
        self._arrived: set[torch.Tensor] = set()  # run members whose first gradient of this backward arrived
        self._unheld = {run: len(run.params) for run in self._runs}  # run -> members not yet arrived
        self.late: set[int] = set()

    def _deliver(self, param: torch.Tensor) -> None:
        grad, param.grad = param.grad, None
        bucket, offset, numel = self._place[param]
        run = self._run_of.get(param)
        if run is not None and param not in self._arrived and self._waiting[bucket]:
            self._arrived.add(param)
            self._held[param] = grad
            self._unheld[run] -= 1
            if not self._unheld[run]:
                self._mark_delivered(bucket, self._fold(run))
            return
        # One parameter: a matrix, or a late or repeated gradient (added after the one held, in that order)
        target = self._buffer_of(bucket)[offset:offset + numel]
        if param in self._held:
            target.add_(self._held.pop(param).reshape(-1))
        target.add_(grad.reshape(-1))
        self._mark_delivered(bucket, (param,))

    def _fold(self, run: VectorRun) -> list[torch.Tensor]:
        """The run's held gradients into its region of the flat buffer, returning their parameters: all of them
        with one concatenation and one add (a GPU launches 2 kernels, not one per parameter); if a member was
        delivered on its own (a repeated gradient), the others one by one."""
        flat, members = self._buffer_of(run.bucket), [p for p in run.params if p in self._held]
        if len(members) == len(run.params):
            flat[run.start:run.end].add_(torch.cat([self._held.pop(p).reshape(-1) for p in members]))
            return members
        for param in members:
            _, offset, numel = self._place[param]
            flat[offset:offset + numel].add_(self._held.pop(param).reshape(-1))
        return members

    def _mark_delivered(self, bucket: int, params) -> None:
        waiting = self._waiting[bucket]
        if not waiting:
            self.late.add(bucket)
            return
        waiting.difference_update(params)
        if not waiting:
            self._on_ready(bucket)

    def flush(self) -> None:
        """End of backward: gradients still held (a run with a member that received none) go into their buffers."""
        for run in self._runs:
            if any(p in self._held for p in run.params):
                self._mark_delivered(run.bucket, self._fold(run))


@dataclass(frozen=True, eq=False)
class VectorRun:
    """Consecutive 1-D parameters of a bucket (biases, norm weights: weight-decay-free parameters lie side by side,
    `flat.build_layout`): elements [start, end) of the bucket's flat buffer."""
    bucket: int
    params: tuple[torch.Tensor, ...]
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
            runs.append(VectorRun(bucket, tuple(layout.params[j] for j in current), layout.offsets[first],
                                  layout.offsets[last] + layout.shapes[last].numel()))
        current = []
    return runs
