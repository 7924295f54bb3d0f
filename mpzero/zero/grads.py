"""Gradient buckets: how the gradients `GradCollector` (collector.py) gathers into flat buffers are reduced.

Two ways to reduce, one per family of stages:
- `ReplicatedGrads` (stages 0, 1): a persistent full gradient buffer per bucket accumulates all
  micro-batches; only the last micro-batch's backward communicates (all-reduce, or a reduce-scatter
  in place into this rank's slice: the `reduction` it is built with), bucket by bucket from the hooks
  when `overlap` is set. Its collector holds 1-D parameters' gradients by runs (`VectorRun`).
- `ShardedGrads` (stages 2, 3): only this rank's gradient slice persists. A full bucket buffer exists
  while one micro-batch's backward fills it and is reduce-scattered, then freed, EVERY micro-batch:
  without full gradients there is nothing to accumulate into, so accumulation costs one reduction
  per micro-batch (the ZeRO paper's stage 2 trade-off). At most MAX_INFLIGHT_REDUCTIONS full buffers
  wait for their reduce-scatter at a time, so the transient gradient memory is bounded by a few buckets.
  With an offloaded optimizer (`host=True`) the slices live in host memory and each reduced bucket is streamed
  there as soon as it is complete (issue 24): the device then holds only buckets in flight. With the optimizer on
  disk (`file`, a `GradFile`) they go on to the disk, each bucket's slice written as it arrives: the host then
  holds two region buffers, not the partition.
Gradients are divided by the DP size before the sum (Megatron's order: less fp16 overflow), which
leaves them averaged over the DP ranks. Expert parameters (partitioned over the expert-DP group, a part of the
ranks whose tokens reach them) are divided by the whole data-parallel size all the same (`divisor`, Megatron's
expert gradient scaling): each expert's gradient already sums the tokens of its EP group, so the result is the
average over every data-parallel rank's tokens, as one process computes it (not EP times it, pytorch#160285).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from mpzero.comm import CommGroup
from mpzero.zero.collector import GradCollector
from mpzero.zero.flat import FlatLayout
from mpzero.zero.meter import TransientMeter
from mpzero.zero.tiers import OffloadHolder, TierBytes, Transfers

if TYPE_CHECKING:
    from mpzero.zero.offload import GradFile


class ReplicatedGrads(OffloadHolder):
    file = None  # full gradient buffers on the device: nothing off it (the tier methods are OffloadHolder's none)
    on_final = None

    def __init__(self, layouts: list[FlatLayout], dp: CommGroup, dtype: torch.dtype, device, overlap: bool,
                 reduction: str, divisor: int | None = None):
        """reduction: "all_reduce" (stage 0: every rank keeps the whole averaged gradient) or "reduce_scatter"
        (stage 1: in place into this rank's slice of the full buffer). divisor: what the summed gradients are
        divided by (default the group's size; see the module docstring)."""
        if reduction not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"reduction {reduction!r} is neither all_reduce nor reduce_scatter")
        self.dp, self._overlap, self._reduction = dp, overlap, reduction
        self.divisor = divisor or dp.size
        self.flats = [torch.zeros(l.padded_numel, dtype=dtype, device=device) for l in layouts]
        self.shards = [f[l.shard_start:l.shard_start + l.shard_numel] for f, l in zip(self.flats, layouts)]
        self._communicate, self._handles, self._launched = False, [], set()
        self.collector = GradCollector(layouts, self.flats.__getitem__, self._ready, persistent=True)

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
            if self.divisor != 1:
                self.flats[bucket].div_(self.divisor)
            return
        flat = self.flats[bucket].div_(self.divisor)
        if self._reduction == "all_reduce":
            self._handles.append(self.dp.all_reduce(flat, async_op=self._overlap))
        else:
            self._handles.append(self.dp.reduce_scatter_into(self.shards[bucket], flat, async_op=self._overlap))

    def end_backward(self) -> None:
        self.collector.flush()
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
        """Gradients from zero for the next step, without a pass over the buffers: the next backward overwrites
        each parameter's place (`GradCollector.overwrite_next`)."""
        self.collector.overwrite_next()

    def held_tensors(self) -> list[torch.Tensor]:
        return list(self.flats)


MAX_INFLIGHT_REDUCTIONS = 1  # full gradient buffers whose reduce-scatter may still run: more overlap would
# keep more of them alive (all of them, unbounded: the whole model's gradients at the end of backward)
IN_TRANSIT = 1  # streamed: reduced shards whose device-to-host copy may still run


class ShardedGrads(OffloadHolder):
    """Only this rank's gradient slice persists (see the module docstring). `host=True` (an offloaded optimizer,
    issue 24 item 3): the slices live in host memory (pinned on CUDA) and each reduced bucket is streamed there
    as soon as its reduce-scatter completes: the reduction lands in a device shard-sized buffer, which is copied to
    the host on a side stream (CUDA; on a CPU run the copy is a plain one) and freed once the next one starts, so
    the device holds the full buckets in flight plus at most MAX_INFLIGHT_REDUCTIONS + IN_TRANSIT reduced shards
    (`accounting.streamed_grad_bytes`), never the gradient partition. Micro-batches after the first land in a
    pinned host buffer (CUDA) and are added to the host slice, the same additions in the same order: bitwise.

    `file` (the optimizer on disk; needs `host`): the slices live in that `GradFile` instead of host memory: each
    streamed slice lands in its first region buffer (on CUDA the pinned landing buffer) and is written to the file
    (a later micro-batch: read back into the second buffer, the new slice added, written again); `shards` is then
    empty. The step's global norm cannot read the file's values cheaply, so the last micro-batch hands each
    bucket's final slice to `on_final(bucket, values)` (set by the optimizer front) right after writing it."""

    def __init__(self, layouts: list[FlatLayout], dp: CommGroup, dtype: torch.dtype, device, overlap: bool,
                 meter: TransientMeter, after_ready: Callable[[int], None] = lambda bucket: None,
                 host: bool = False, pin: bool = False, file: GradFile | None = None, divisor: int | None = None):
        if file is not None and not host:
            raise ValueError("gradients on disk are streamed through host memory: pass host=True with file")
        self.dp, self._layouts, self._dtype, self._device = dp, layouts, dtype, torch.device(device)
        self.divisor = divisor or dp.size
        self.overlap, self._after_ready, self._meter = overlap, after_ready, meter
        self.streamed, self.file = host, file
        self.on_final: Callable[[int, torch.Tensor], None] | None = None
        self._last = False  # this micro-batch's slices are final (the last micro-batch of the step)
        self.device_meter = TransientMeter()  # gradient bytes on the device: shards (unstreamed), buckets, transit
        cuda = self._device.type == "cuda"
        pin = pin and host and cuda
        where = torch.device("cpu") if host else self._device
        self.shards = [] if file is not None else [torch.zeros(l.shard_numel, dtype=dtype, device=where,
                                                               pin_memory=pin) for l in layouts]
        if not host:
            self.device_meter.add(sum(shard.nbytes for shard in self.shards))
        self._zeroed = set(range(len(layouts)))  # buckets whose shard holds zeros (nothing reduced since zero_())
        self._full: dict[int, torch.Tensor] = {}  # bucket -> full gradient buffer of this micro-batch
        self._inflight = []  # (bucket, handle, reduced slice, full buffer kept alive until the wait, first)
        self._transit = []  # streamed: (bucket, reduced device slice, host landing, event or None, first)
        self._launched: set[int] = set()
        self.device_to_host = 0  # bytes copied to the host by streaming (0 on a CPU run: the device is the host)
        self._stream = torch.cuda.Stream(self._device) if host and cuda else None
        largest = max((l.shard_numel for l in layouts), default=0)
        self._landing = (torch.empty(largest, dtype=dtype, pin_memory=pin) if host and cuda and file is None
                         else None)
        self.collector = GradCollector(layouts, self._full_buffer, self._ready, persistent=False)

    def _add(self, nbytes: int) -> None:
        self._meter.add(nbytes)
        self.device_meter.add(nbytes)

    def _sub(self, nbytes: int) -> None:
        self._meter.sub(nbytes)
        self.device_meter.sub(nbytes)

    def _full_buffer(self, bucket: int) -> torch.Tensor:
        """Uninitialised but its padding: the collector overwrites each place and zeroes the rest before the
        reduction (`GradCollector.fresh`, `zero_unwritten`), with no pass over the buffer first."""
        if bucket not in self._full:
            layout = self._layouts[bucket]
            full = self._full[bucket] = torch.empty(layout.padded_numel, dtype=self._dtype, device=self._device)
            if layout.padding:
                full[layout.numel:].zero_()
            self._add(full.nbytes)
            self.collector.fresh(bucket)
        return self._full[bucket]

    def begin_backward(self, last_micro_batch: bool) -> None:
        self._launched = set()
        self._last = last_micro_batch
        self.collector.reset()

    def _ready(self, bucket: int) -> None:
        if self.overlap:
            self._launch(bucket)
        self._after_ready(bucket)

    def _launch(self, bucket: int) -> None:
        full = self._full_buffer(bucket)
        self.collector.zero_unwritten(bucket)
        if self.divisor > 1:  # a division by 1: no pass over the buffer
            full.div_(self.divisor)
        del self._full[bucket]
        self._launched.add(bucket)
        while len(self._inflight) >= MAX_INFLIGHT_REDUCTIONS:
            self._complete_oldest()
        # The first reduction after zero_() lands in the shard itself (0 + x = x; only a -0.0 stays -0.0, which
        # no later step tells from +0.0); later micro-batches reduce into a temporary that is added to it.
        # Streamed, every reduction lands in a device temporary on its way to the host.
        first = bucket in self._zeroed
        self._zeroed.discard(bucket)
        if self.streamed:
            reduced = torch.empty(self._layouts[bucket].shard_numel, dtype=self._dtype, device=self._device)
            self._add(reduced.nbytes)
        else:
            reduced = self.shards[bucket] if first else torch.empty_like(self.shards[bucket])
        # an empty bucket (a stage-3 root without parameters of its group) has nothing to reduce
        handle = self.dp.reduce_scatter_into(reduced, full, async_op=self.overlap) if full.numel() else None
        self._inflight.append((bucket, handle, reduced, full, first))

    def _complete_oldest(self) -> None:
        """Wait for the oldest reduction, drop its full buffer, and add its result to the shard (streamed: send it
        to the host)."""
        bucket, handle, reduced, full, first = self._inflight.pop(0)
        if handle is not None:
            handle.wait()
        self._sub(full.nbytes)
        del full
        if self.streamed:
            self._send(bucket, reduced, first)
        elif not first:
            self.shards[bucket].add_(reduced)

    def _send(self, bucket: int, reduced: torch.Tensor, first: bool) -> None:
        """The reduced slice to the host: into the shard (first micro-batch) or a landing buffer added to it when
        the copy is done; the previous copy is finished first (IN_TRANSIT)."""
        while len(self._transit) >= IN_TRANSIT:
            self._finish_oldest_send()
        host = reduced.device.type == "cpu"
        if self.file is not None:  # the first region buffer, on its way to the file (once the last write is done)
            self.file.wait()
            target = self.file.buffers[0][:reduced.numel()]
        else:
            target = self.shards[bucket] if first else (reduced if host else self._landing[:reduced.numel()])
        event = None
        if self._stream is not None:  # CUDA: a side stream, after the reduction on the current one
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(self._stream):
                target.copy_(reduced, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            reduced.record_stream(self._stream)
        elif target is not reduced:
            target.copy_(reduced)
        if not host:
            self.device_to_host += reduced.nbytes
        self._transit.append((bucket, reduced, target, event, first))

    def _finish_oldest_send(self) -> None:
        bucket, reduced, target, event, first = self._transit.pop(0)
        if event is not None:
            event.synchronize()
        if self.file is not None:
            self._to_file(bucket, target, first)
        elif not first:
            self.shards[bucket].add_(target)
        self._sub(reduced.nbytes)

    def _to_file(self, bucket: int, arrived: torch.Tensor, first: bool) -> None:
        """The slice that arrived (in the first region buffer) into bucket's region: as it is after zero_(), else
        added to what the region holds (read into the second buffer); the last micro-batch's to `on_final`."""
        buffer = self.file.buffers[0]  # holds `arrived`
        values = arrived
        if not first:
            self.file.wait()  # buffer 1 may still be on its way out
            buffer = self.file.buffers[1]
            values = self.file.read(bucket, buffer)
            values.add_(arrived)
        self.file.write_behind(bucket, buffer)  # overlaps the rest of backward; the norm only reads the buffer
        if self._last and self.on_final is not None:
            self.on_final(bucket, values)

    def end_backward(self) -> None:
        self.collector.flush()
        for bucket in range(len(self.shards)):
            if bucket not in self._launched or bucket in self._full:  # not yet reduced, or late gradients
                self._launch(bucket)
        while self._inflight:
            self._complete_oldest()
        while self._transit:
            self._finish_oldest_send()
        if self.file is not None:
            self.file.wait()

    def zero_(self) -> None:
        for shard in self.shards:
            shard.zero_()
        self._zeroed = set(range(len(self._layouts)))

    def held_tensors(self) -> list[torch.Tensor]:
        """Device storage between steps: the shards (streamed: none; they are host state, `host_tensors`)."""
        return [] if self.streamed else list(self.shards)  # full buckets exist only during a micro-batch's backward

    def host_tensors(self) -> list[torch.Tensor]:
        return list(self.shards) if self.streamed else []

    def tier_bytes(self) -> TierBytes:
        """Streamed: the host slices (state) and the landing buffer (CUDA); on disk: the file and its two region
        buffers."""
        return TierBytes(host=sum(t.untyped_storage().nbytes() for t in self.host_tensors()),
                         host_buffers=sum(t.untyped_storage().nbytes() for t in self.host_buffers()),
                         disk=self.file.nbytes if self.file is not None else 0)

    def transfers(self) -> Transfers:
        if self.file is None:
            return Transfers(device_to_host=self.device_to_host)
        return Transfers(device_to_host=self.device_to_host, disk_read=self.file.file.bytes_read,
                         disk_written=self.file.file.bytes_written)

    def host_buffer_formula(self) -> tuple[int, str]:
        """(bytes, text): the landing buffer of one largest shard in the gradients' dtype (CUDA, streamed), or the
        gradient file's two region buffers."""
        if self.file is not None:
            return self.file.host_buffer_formula()
        if self._landing is None:
            return 0, "0"
        largest = max((layout.shard_numel for layout in self._layouts), default=0)
        return self._dtype.itemsize * largest, f"{self._dtype.itemsize}S"

    def host_buffers(self) -> list[torch.Tensor]:
        if self.file is not None:
            return list(self.file.buffers)
        return [self._landing] if self._landing is not None else []

    def check_files(self) -> None:
        if self.file is not None:
            self.file.check()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
