"""Stage 3's parameter shards off the device (ZeRO-Infinity's parameter offload): this rank's low-precision
shard of every unit lives in host memory (`cpu`) or in one file (`disk`), and reaches the device only to be
gathered.

Fetch (driven by `Stage3`): `read_ahead(u)` starts bringing unit u's shard towards the device while earlier
units compute (disk: a read on the I/O thread; then, at DP > 1, a host-to-device copy into a staging buffer,
on a side stream on CUDA); `fetch(u)` hands it over (DP > 1: the staging buffer, for the all-gather; DP 1: a
copy straight into the unit's full buffer, with no staging); `done(u)` frees its buffers once the gather is
complete. Stage 3 gathers the next unit while reading the one after it (ZeRO-Infinity's overlap-centric
prefetch, two deep).

Buffers, a fixed number whatever the model size: SLOTS slots, each holding one unit's shard at a time: a device
staging buffer (DP > 1 only; allocated while it holds a shard, counted by the stage's meter) and, for the disk
tier, an aligned host buffer (pinned on CUDA) of the largest unit's file region. The disk tier's writes borrow
the same host buffers. The cpu tier at DP 1 needs no slot at all.

As the `ParamSink` of the master store (bucket = unit): the cpu tier copies the values into its host shard;
the disk tier collects one unit's pieces in a slot's host buffer and writes the unit's region whole (one
aligned write, O_DIRECT where the file system allows) once the pieces cover the unit's parameters, when the
store moves on to another unit, or at `flush()`: at most one unit being filled and one being written.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from mpzero.errors import ConfigError
from mpzero.zero.offload.directory import OffloadDirectory
from mpzero.zero.tiers import ParamSink, TierBytes, Transfers
from mpzero.zero.offload.swap import aligned_bytes, aligned_empty, round_up
from mpzero.zero.config import OffloadConfig
from mpzero.zero.flat import FlatLayout
from mpzero.zero.meter import TransientMeter

SLOTS = 2  # the unit being all-gathered next and the one read ahead of it


class _Slot:
    def __init__(self, host: torch.Tensor | None):
        self.host = host  # disk tier: aligned read/write buffer
        self.unit: int | None = None
        self.state: str | None = None  # None free, "ahead" read ahead, "fetched" handed over, "filling" by the sink
        self.device: torch.Tensor | None = None  # DP > 1: the staging buffer, while the slot holds a shard
        self.job = None  # the I/O thread's read or write of `host`
        self.copied = None  # CUDA event: the host-to-device copy out of `host` (into `device`) is complete


class _Copied:
    """The handle of a copy into a unit's full buffer (DP 1), waited like a collective's."""

    def __init__(self, event, device: torch.device):
        self.event, self.device = event, device

    def wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)


class ParamTier(ParamSink):
    def __init__(self, layouts: list[FlatLayout], dtype: torch.dtype, device, offload: OffloadConfig,
                 directory: OffloadDirectory | str | None, meter: TransientMeter, staging: bool):
        """staging: the shards are all-gathered from device staging buffers (DP > 1); else (DP 1) copied
        straight into the full buffers. directory (disk tier): the optimizer's `OffloadDirectory`, or a path this
        tier locks, creates and removes."""
        self.dtype, self.device, self.kind = dtype, torch.device(device), offload.params
        self._meter, self._staging = meter, staging
        self.numels = [layout.shard_numel for layout in layouts]
        # Elements of the shard that hold parameters (the rest is padding, never written by a master store).
        self._valid = [min(max(l.numel - l.shard_start, 0), l.shard_numel) for l in layouts]
        cuda = self.device.type == "cuda"
        pin = offload.pin_memory and cuda
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._host_copies: dict[int, object] = {}  # cpu tier: unit -> event of a copy still reading its shard
        self._h2d = self._d2h = 0
        self._base = Transfers()
        self._pending = None  # disk tier: (unit, slot, [(start, end), ...]) being filled by the store
        self._writes = []
        self._file = self._io = self._directory = None
        if self.kind == "cpu":
            self.host = [torch.zeros(n, dtype=dtype, pin_memory=pin) for n in self.numels]
            self.param_shards = self.host
            self._slots = [_Slot(None) for _ in range(SLOTS)] if staging else []
            return
        if not directory:
            raise ConfigError("--offload-params disk needs a folder for this rank's file: pass --offload-path DIR")
        item = torch.empty((), dtype=dtype).element_size()
        self._regions = [round_up(n * item) // item for n in self.numels]  # one aligned region per unit
        self._offsets = [sum(self._regions[:u]) * item for u in range(len(layouts))]
        # a path: this tier locks, creates and removes it; else the optimizer's, shared with its master store
        self._directory = OffloadDirectory(directory) if isinstance(directory, str) else None
        try:
            self._file = (self._directory or directory).swap_file("params.swap", sum(self._regions) * item,
                                                                  offload.io)
        except BaseException:
            if self._directory is not None:
                self._directory.close()
            raise
        self._io = ThreadPoolExecutor(1, thread_name_prefix="mpzero-param-io")  # reads and writes in order
        largest = max(self._regions, default=0)
        self._slots = [_Slot(aligned_empty(largest, dtype, pin)) for _ in range(SLOTS)]
        self._buffer_bytes = SLOTS * aligned_bytes(largest, dtype)
        self.param_shards = [torch.empty(n, dtype=dtype, device="meta") for n in self.numels]  # shape and dtype only

    # -- fetch --------------------------------------------------------------------------------------
    def read_ahead(self, u: int) -> None:
        """Start bringing unit u's shard towards the device, if a slot is free (best effort)."""
        if self._slots and self._slot_of(u) is None:
            slot = self._claim(evict=False)
            if slot is not None:
                self._load(slot, u, "ahead")

    def can_fetch(self, u: int) -> bool:
        """False when every slot holds a shard handed over for a gather still in flight."""
        return (not self._slots or self._slot_of(u) is not None
                or any(slot.state in (None, "ahead") for slot in self._slots))

    def fetch(self, u: int, into: torch.Tensor | None = None):
        """DP > 1: the device tensor holding unit u's shard, ready for a collective on the current stream.
        DP 1 (`into`: the unit's full buffer): copies the shard into it; returns the copy's handle (`wait()`)."""
        slot = self._slot_of(u)
        if slot is None and self._slots:
            slot = self._claim(evict=True)
            self._load(slot, u, "fetched")
        if slot is not None:
            slot.state = "fetched"
            if slot.job is not None:
                slot.job.result()
                slot.job = None
        if into is None:
            self._wait_on_device(slot.copied)
            return slot.device
        source = self.host[u] if slot is None else slot.host[:self.numels[u]]
        copied = self._copy(into, source, self._mark())
        if slot is None:
            self._host_copies[u] = copied
        else:
            slot.copied = copied
        return _Copied(copied, self.device)

    def done(self, u: int) -> None:
        """The gather of unit u is complete: its slot is free again."""
        slot = self._slot_of(u)
        if slot is not None and slot.state == "fetched":
            self._free(slot)

    def discard(self) -> None:
        """Drop the shards read ahead and not fetched (between steps no staging buffer exists)."""
        for slot in self._slots:
            if slot.state == "ahead":
                self._free(slot)

    def staging(self) -> list[torch.Tensor]:
        return [slot.device for slot in self._slots if slot.device is not None]

    def _slot_of(self, u: int) -> _Slot | None:
        return next((s for s in self._slots if s.unit == u and s.state in ("ahead", "fetched")), None)

    def _claim(self, evict: bool) -> _Slot | None:
        """A free slot whose host buffer nothing reads or writes any more; `evict`: drop a read-ahead if none."""
        slot = next((s for s in self._slots if s.state is None), None)
        if slot is None and evict:
            slot = next((s for s in self._slots if s.state == "ahead"), None)
            if slot is None:
                raise RuntimeError("every parameter staging slot holds a shard being gathered")
            self._free(slot)
        if slot is not None:
            if slot.job is not None:  # a write of its host buffer
                slot.job.result()
                slot.job = None
            if slot.copied is not None and slot.host is not None:  # a copy may still read the host buffer
                slot.copied.synchronize()
            slot.copied = None
        return slot

    def _load(self, slot: _Slot, u: int, state: str) -> None:
        slot.unit, slot.state = u, state
        if self._staging:
            slot.device = torch.empty(self.numels[u], dtype=self.dtype, device=self.device)
            self._meter.add(slot.device.nbytes)
        ready = self._mark()
        if slot.host is not None:
            slot.job = self._io.submit(self._read, slot, u, ready)
        elif self._staging:
            slot.copied = self._copy(slot.device, self.host[u], ready)
            self._host_copies[u] = slot.copied

    def _read(self, slot: _Slot, u: int, ready) -> None:  # on the I/O thread
        self._file.read(self._offsets[u], slot.host[:self._regions[u]])
        if slot.device is not None:
            slot.copied = self._copy(slot.device, slot.host[:self.numels[u]], ready)

    def _free(self, slot: _Slot) -> None:
        if slot.job is not None:  # a read still running into this slot
            slot.job.result()
            slot.job = None
        if slot.device is not None:
            self._wait_on_device(slot.copied)  # the allocator may hand the memory to the compute stream next
            self._meter.sub(slot.device.nbytes)
            slot.device = None
        slot.unit = slot.state = None

    # -- device copies -------------------------------------------------------------------------------
    def _mark(self):
        """CUDA: an event at this point of the compute stream (where the copy's destination was allocated)."""
        return None if self._stream is None else torch.cuda.current_stream(self.device).record_event()

    def _copy(self, dest: torch.Tensor, source: torch.Tensor, ready):
        """dest <- source (host to device); on CUDA asynchronous on the side stream after `ready`: returns the
        event that completes it (None: done)."""
        if self.device.type != "cpu":
            self._h2d += source.nbytes
        if self._stream is None:
            dest.copy_(source)
            return None
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            dest.copy_(source, non_blocking=True)
            return self._stream.record_event()

    def _wait_on_device(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    # -- sink: the master store's updated values ------------------------------------------------------
    def write(self, bucket: int, start: int, values: torch.Tensor) -> None:
        n = values.numel()
        if values.device.type != "cpu":
            self._d2h += n * values.element_size()
        stale = self._slot_of(bucket)
        if stale is not None:
            if stale.state == "fetched":
                raise RuntimeError(f"unit {bucket}'s parameters were written while it is being gathered")
            self._free(stale)
        if self.kind == "cpu":
            copy = self._host_copies.pop(bucket, None)
            if copy is not None:  # a copy to the device may still read the old values
                copy.synchronize()
            self.host[bucket][start:start + n].copy_(values.reshape(-1))
            return
        if self._pending is not None and self._pending[0] != bucket:
            self._write_out()
        if self._pending is None:
            slot = self._claim(evict=True)
            slot.unit, slot.state = bucket, "filling"
            slot.host[self._valid[bucket]:self._regions[bucket]].zero_()  # padding and alignment tail
            self._pending = (bucket, slot, [])
        _, slot, pieces = self._pending
        slot.host[start:start + n].copy_(values.reshape(-1))
        pieces.append((start, start + n))
        if _covers(pieces, self._valid[bucket]):
            self._write_out()

    def _write_out(self) -> None:
        u, slot, pieces = self._pending
        self._pending = None
        region = slot.host[:self._regions[u]]
        if not _covers(pieces, self._valid[u]):  # the rest keeps its values: merge into the unit as stored
            merged = self._claim(evict=True)
            self._io.submit(self._file.read, self._offsets[u], merged.host[:self._regions[u]]).result()
            for start, end in pieces:
                merged.host[start:end].copy_(slot.host[start:end])
            slot.unit = slot.state = None
            slot, region = merged, merged.host[:self._regions[u]]
        slot.unit = slot.state = None
        slot.job = self._io.submit(self._file.write, self._offsets[u], region)
        self._writes.append(slot.job)

    def flush(self) -> None:
        """The ParamSink contract, as the master store uses it (once per sub-group): the values written so far
        were copied in (write() copies at once) and every unit completed so far is on disk. A unit still being
        filled stays in its buffer: writing it out here would rewrite a whole unit at every sub-group boundary
        inside it (measured: 12x the pP/N a step should write, and a read of the unit to merge each time)."""
        writes, self._writes = self._writes, []
        for write in writes:
            write.result()

    def finish(self) -> None:
        """Everything written is on disk, a unit left partly written included (merged into its stored values):
        the stage calls this before the next gather reads the file."""
        if self._pending is not None:
            self._write_out()
        self.flush()

    # -- accounting ------------------------------------------------------------------------------------
    def _counted(self) -> Transfers:
        read, written = (self._file.bytes_read, self._file.bytes_written) if self._file else (0, 0)
        return Transfers(self._d2h, self._h2d, read, written)

    def mark(self) -> None:
        """From here on transfers count (the initial placement is not a step's traffic)."""
        self._base = self._counted()

    def traffic(self) -> Transfers:
        """Everything the tier moved since `mark()`: fetches to the device, disk reads and writes (the stage
        reports it)."""
        return self._counted() - self._base

    def transfers(self) -> Transfers:
        return Transfers()  # as a sink: counted once, by the stage (`traffic`), not again by the master store

    def tier_bytes(self) -> TierBytes:
        if self.kind == "cpu":
            return TierBytes(host=sum(t.untyped_storage().nbytes() for t in self.host))
        return TierBytes(host_buffers=self._buffer_bytes, disk=self._file.nbytes)

    def host_buffer_formula(self) -> tuple[int, str]:
        """Disk tier: SLOTS buffers of U = the largest unit's shard rounded up to 4096 bytes, plus 4096 of
        alignment slack."""
        return (self._buffer_bytes, f"{SLOTS}U") if self.kind == "disk" else (0, "0")

    def check_files(self) -> None:
        if self._file is not None:
            self._file.check()

    def close(self) -> None:
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._file.close(remove=True)
            self._io = None
            if self._directory is not None:
                self._directory.close()


def _covers(pieces: list[tuple[int, int]], end: int) -> bool:
    """Whether the pieces cover [0, end)."""
    reached = 0
    for start, stop in sorted(pieces):
        if start > reached:
            break
        reached = max(reached, stop)
    return reached >= end
