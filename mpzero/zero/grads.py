"""Gradient buckets: gradients leave `param.grad` for flat buffers as autograd produces them.

`GradCollector` hooks every parameter's post-accumulate-grad event: the fresh gradient is added into
the parameter's place in its bucket's flat buffer (upcast to the buffer's dtype: bf16 gradients
accumulate in fp32) and `param.grad` is dropped, so autograd's copy lives only until its hook runs.
A bucket is reported ready once every parameter in it has delivered; this also holds under reentrant
activation checkpointing, where the hooks fire inside the recomputation's inner backward. A parameter
that delivers again after its bucket was reported (used in two reentrant regions) is recorded as late.

Two ways to reduce, one per family of stages:
- `ReplicatedGrads` (stages 0, 1): a persistent full gradient buffer per bucket accumulates all
  micro-batches; only the last micro-batch's backward communicates (all-reduce, or a reduce-scatter
  in place into this rank's slice: the `reduction` it is built with), bucket by bucket from the hooks
  when `overlap` is set.
- `ShardedGrads` (stages 2, 3): only this rank's gradient slice persists. A full bucket buffer exists
  while one micro-batch's backward fills it and is reduce-scattered, then freed, EVERY micro-batch:
  without full gradients there is nothing to accumulate into, so accumulation costs one reduction
  per micro-batch (the ZeRO paper's stage 2 trade-off). At most MAX_INFLIGHT_REDUCTIONS full buffers
  wait for their reduce-scatter at a time, so the transient gradient memory is bounded by a few buckets.
Gradients are divided by the DP size before the sum (Megatron's order: less fp16 overflow), which
leaves them averaged over the DP ranks.
"""

from __future__ import annotations

from typing import Callable

import torch

from mpzero.comm import CommGroup
from mpzero.zero.flat import FlatLayout
from mpzero.zero.meter import TransientMeter


class GradCollector:
    def __init__(self, layouts: list[FlatLayout], buffer_of: Callable[[int], torch.Tensor],
                 on_ready: Callable[[int], None]):
        self._buffer_of, self._on_ready = buffer_of, on_ready
        self._place = {}  # param -> (bucket, offset, numel)
        for b, layout in enumerate(layouts):
            for param, offset, shape in zip(layout.params, layout.offsets, layout.shapes):
                self._place[param] = (b, offset, shape.numel())
        self._members = [set(layout.params) for layout in layouts]
        self._hooks = [p.register_post_accumulate_grad_hook(self._deliver) for p in self._place]
        self.reset()

    def reset(self) -> None:
        self._waiting = [set(members) for members in self._members]
        self.late: set[int] = set()

    def _deliver(self, param: torch.Tensor) -> None:
        bucket, offset, numel = self._place[param]
        self._buffer_of(bucket)[offset:offset + numel].add_(param.grad.reshape(-1))
        param.grad = None
        waiting = self._waiting[bucket]
        if not waiting:
            self.late.add(bucket)
            return
        waiting.discard(param)
        if not waiting:
            self._on_ready(bucket)


class ReplicatedGrads:
    def __init__(self, layouts: list[FlatLayout], dp: CommGroup, dtype: torch.dtype, device, overlap: bool,
                 reduction: str):
        """reduction: "all_reduce" (stage 0: every rank keeps the whole averaged gradient) or "reduce_scatter"
        (stage 1: in place into this rank's slice of the full buffer)."""
        if reduction not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"reduction {reduction!r} is neither all_reduce nor reduce_scatter")
        self.dp, self._overlap, self._reduction = dp, overlap, reduction
        self.flats = [torch.zeros(l.padded_numel, dtype=dtype, device=device) for l in layouts]
        self.shards = [f[l.shard_start:l.shard_start + l.shard_numel] for f, l in zip(self.flats, layouts)]
        self._communicate, self._handles, self._launched = False, [], set()
        self.collector = GradCollector(layouts, self.flats.__getitem__, self._ready)

    def begin_backward(self, last_micro_batch: bool) -> None:
        self._communicate = last_micro_batch
        self._handles, self._launched = [], set()
        self.collector.reset()

    def _ready(self, bucket: int) -> None:
        if self._communicate and self._overlap:
            self._launch(bucket)

    def _launch(self, bucket: int) -> None:
        if bucket in self._launched:
            raise RuntimeError(f"gradient bucket {bucket} received a gradient after it was reduced (a parameter "
                               "used in two reentrant checkpoint regions?): use ZeroConfig(overlap_comm=False)")
        self._launched.add(bucket)
        if self.dp.size == 1:  # the buffer is the whole reduced gradient already (its "shard" is all of it)
            return
        flat = self.flats[bucket].div_(self.dp.size)
        if self._reduction == "all_reduce":
            self._handles.append(self.dp.all_reduce(flat, async_op=self._overlap))
        else:
            self._handles.append(self.dp.reduce_scatter_into(self.shards[bucket], flat, async_op=self._overlap))

    def end_backward(self) -> None:
        if not self._communicate:
            return
        for bucket in range(len(self.flats)):
            if bucket not in self._launched or bucket in self.collector.late:
                self._launch(bucket)  # raises for a late bucket: its reduction already started
        for handle in self._handles:
            if handle is not None:
                handle.wait()
        self._handles = []

    def zero_(self) -> None:
        for flat in self.flats:
            flat.zero_()

    def held_tensors(self) -> list[torch.Tensor]:
        return list(self.flats)


MAX_INFLIGHT_REDUCTIONS = 1  # full gradient buffers whose reduce-scatter may still run: more overlap would
# keep more of them alive (all of them, unbounded: the whole model's gradients at the end of backward)


class ShardedGrads:
    def __init__(self, layouts: list[FlatLayout], dp: CommGroup, dtype: torch.dtype, device, overlap: bool,
                 meter: TransientMeter, after_ready: Callable[[int], None] = lambda bucket: None):
        self.dp, self._layouts, self._dtype, self._device = dp, layouts, dtype, device
        self.overlap, self._after_ready, self._meter = overlap, after_ready, meter
        self.shards = [torch.zeros(l.shard_numel, dtype=dtype, device=device) for l in layouts]
        self._zeroed = set(range(len(layouts)))  # buckets whose shard holds zeros (nothing reduced since zero_())
        self._full: dict[int, torch.Tensor] = {}  # bucket -> full gradient buffer of this micro-batch
        self._inflight = []  # (bucket, handle, reduced slice, full buffer kept alive until the wait)
        self._launched: set[int] = set()
        self.collector = GradCollector(layouts, self._full_buffer, self._ready)

    def _full_buffer(self, bucket: int) -> torch.Tensor:
        if bucket not in self._full:
            numel = self._layouts[bucket].padded_numel
            self._full[bucket] = torch.zeros(numel, dtype=self._dtype, device=self._device)
            self._meter.add(self._full[bucket].nbytes)
        return self._full[bucket]

    def begin_backward(self, last_micro_batch: bool) -> None:
        self._launched = set()
        self.collector.reset()

    def _ready(self, bucket: int) -> None:
        if self.overlap:
            self._launch(bucket)
        self._after_ready(bucket)

    def _launch(self, bucket: int) -> None:
        full = self._full_buffer(bucket)
        if self.dp.size > 1:  # at DP 1 a division by 1: no pass over the buffer
            full.div_(self.dp.size)
        del self._full[bucket]
        self._launched.add(bucket)
        # The first reduction after zero_() lands in the shard itself (0 + x = x; only a -0.0 stays -0.0, which
        # no later step tells from +0.0); later micro-batches reduce into a temporary that is added to it.
        reduced = None if bucket in self._zeroed else torch.empty_like(self.shards[bucket])
        self._zeroed.discard(bucket)
        handle = self.dp.reduce_scatter_into(self.shards[bucket] if reduced is None else reduced, full,
                                             async_op=self.overlap)
        self._inflight.append((bucket, handle, reduced, full))
        while len(self._inflight) > MAX_INFLIGHT_REDUCTIONS:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        """Wait for the oldest reduction, add its result to the shard and drop its full buffer."""
        bucket, handle, reduced, full = self._inflight.pop(0)
        if handle is not None:
            handle.wait()
        if reduced is not None:
            self.shards[bucket].add_(reduced)
        self._meter.sub(full.nbytes)

    def end_backward(self) -> None:
        for bucket in range(len(self.shards)):
            if bucket not in self._launched or bucket in self._full:  # not yet reduced, or late gradients
                self._launch(bucket)
        while self._inflight:
            self._complete_oldest()

    def zero_(self) -> None:
        for shard in self.shards:
            shard.zero_()
        self._zeroed = set(range(len(self.shards)))

    def held_tensors(self) -> list[torch.Tensor]:
        return list(self.shards)  # full buckets exist only during one micro-batch's backward
