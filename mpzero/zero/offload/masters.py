"""ZeRO-Offload and ZeRO-Infinity for the optimizer: this rank's fp32 masters and the update rule's states in host
memory (tier "cpu") or in files (tier "disk"), updated by the rule on the CPU, bit for bit as `DeviceMasters` on
the CPU.

The partition is the concatenation of the buckets' shards (padding included), processed in sub-groups of
`sub_group_numel` elements that may cross buckets, parameters and decay runs. Per sub-group k:

    gradients device -> host (pinned staging, side stream; k+1's copy overlaps k's update)     on the device only
    (gradients already in host memory, a CPU run or streamed there in backward, are read in place; low-precision
    ones are cast, unscaled and clipped a piece at a time, `Fp32Buckets.piece`: 4 x 2G bytes of fp32 at most;
    gradients on disk are read back bucket by bucket, the next one ahead, `FileGrads`)
    disk: masters and states read from one file each (k+1 read and k-1 written while k updates)
    the rule's step on the host, then the new parameters, cast to the model's dtype, to the sink (staging buffer)

Host memory of the disk tier is its buffers (`buffer_bytes`, sizing.py), whatever the model size: the files hold
the state, element i of the partition at byte 4*i of each.

Exactness: a vectorized CPU kernel (torch's fused AdamW, torch's elementwise ops) runs a SIMD body and a scalar
tail that round differently, so a call's result depends on where the call starts and ends. Every element is updated
through the rule's `windows` (`mpzero.optim.canonical_windows`), which gives it the code path it has in the
one-call-per-decay-run of `DeviceMasters`, whatever the sub-groups.
"""

from __future__ import annotations

import functools
from collections import deque

import torch

from mpzero.errors import ConfigError
from mpzero.optim import BLOCK, UpdateRule, canonical_windows  # noqa: F401  (canonical_windows: re-exported)
from mpzero.zero.offload.directory import OffloadDirectory
from mpzero.zero.offload.sizing import buffer_formula, group_numel, round_to_block, stored_states
from mpzero.zero.offload.sizing import buffer_bytes  # noqa: F401  (re-exported: tests)
from mpzero.zero.tiers import ParamSink, TierBytes, Transfers
from mpzero.zero.offload.swap import ALIGN, SwapFile, SwapPipeline, aligned_empty
from mpzero.zero.config import OffloadConfig, OptimizerConfig
from mpzero.zero.flat import FlatLayout
from mpzero.zero.masters import MasterStore, OwnedPiece
from mpzero.zero.norm import scale_grads_
from mpzero.zero.step_grads import Fp32Buckets


def _piece(grads, bucket: int, lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of bucket's fp32 gradients: a view, or a cast piece of `Fp32Buckets`."""
    return grads.piece(bucket, lo, hi) if isinstance(grads, Fp32Buckets) else grads[bucket][lo:hi]


class OffloadedMasters(MasterStore):
    """Masters and the rule's states off the device: tier "cpu" (host tensors) or "disk" (one file per state under
    `directory`, streamed through `offload.buffer_count` buffers). See the module docstring. `directory`: an
    `OffloadDirectory` shared with stage 3's parameter tier, or a path that this store locks, creates and removes.
    `staged_grads`: the step's gradients are on the device (stage 1) and come down through pinned staging slots;
    False when the stage streams them to host memory in backward (stages 2-3): no slots.

    Single-threaded use: call its methods from one thread; it runs its own I/O threads. Call `close()` when done
    (stops the threads, closes and removes the files: they are scratch, a checkpoint holds the state).
    """

    def __init__(self, layouts: list[FlatLayout], sink: ParamSink, initial: list[torch.Tensor], config: OptimizerConfig,
                 offload: OffloadConfig, directory: OffloadDirectory | str | None, device: torch.device,
                 staged_grads: bool = True):
        if offload.optimizer not in ("cpu", "disk"):
            raise ConfigError(f"OffloadedMasters needs --offload-optimizer cpu or disk, got {offload.optimizer!r}")
        self.config, self.rule, self.layouts, self.sink, self.offload = config, config.rule, layouts, sink, offload
        self.states = stored_states(self.rule)
        self.tier = offload.optimizer
        self.device, self.cuda = torch.device(device), torch.device(device).type == "cuda"
        self._slots = self.cuda and staged_grads  # pinned gradient staging for device gradients
        self.impl = self.rule.resolve_impl(torch.device("cpu"), config.impl)
        self.step_count = 0
        self._lay_out(layouts)
        total = self.numel
        self.group = min(offload.sub_group_numel, max(total, 1))  # elements per sub-group
        self._count = -(-total // self.group)
        self._capacity = group_numel(offload, total)
        self._buffers: list[torch.Tensor] = []  # every host buffer, for tier_bytes
        self._make_staging(sink.dtype, self.cuda and offload.pin_memory)
        self._maps: dict[str, torch.Tensor] | None = None
        self._files: dict[str, SwapFile] = {}
        self._own_directory = False
        self._pipe = None
        if self.tier == "cpu":
            # Not pinned: transfers go through the pinned staging buffers, never from the state itself.
            self._host = {name: torch.zeros(total, dtype=torch.float32) for name in self.states}
            for (_, off, end), values in zip(self._spans, initial):
                self._host["master"][off:end].copy_(values)
            self.io_mode = None
        else:
            self._open_files(directory, total)
            try:
                self._pipe = SwapPipeline([{name: self._buffer(torch.float32) for name in self.states}
                                           for _ in range(offload.buffer_count)])
                self._write_initial(initial)
            except BaseException:  # e.g. the disk filled up: no file of ours stays behind
                self.close()
                raise

    def _lay_out(self, layouts: list[FlatLayout]) -> None:
        """Where each bucket's shard starts in the partition (`_offsets`), its decayed and undecayed runs, the
        elements a step changes per bucket (`_active`: its runs are adjacent, decayed then not), whole shards."""
        self._offsets, total = [], 0
        for layout in layouts:
            self._offsets.append(total)
            total += layout.shard_numel
        self.numel = total
        self._runs = [(off + s, off + e, decay) for off, layout in zip(self._offsets, layouts)
                      for s, e, decay in layout.decay_runs()]
        self._active = [(b, off + runs[0][0], off + runs[-1][1]) for b, (off, layout) in
                        enumerate(zip(self._offsets, layouts)) if (runs := layout.decay_runs())]
        self._spans = [(b, off, off + layout.shard_numel)
                       for b, (off, layout) in enumerate(zip(self._offsets, layouts))]

    def _buffer(self, dtype: torch.dtype, pinned: bool = False) -> torch.Tensor:
        """A host buffer of one sub-group, 4 KiB-aligned, counted in tier_bytes."""
        tensor = aligned_empty(self._capacity, dtype, pinned)
        self._buffers.append(tensor)
        return tensor

    def _make_staging(self, param_dtype: torch.dtype, pin: bool) -> None:
        """The parameter staging buffer, the step's scratch and, for device gradients, two gradient slots."""
        self._param_staging = self._buffer(param_dtype, pin)
        self._scratch = torch.zeros(2 + len(self.rule.state_names), self.rule.block, dtype=torch.float32)
        self._buffers.append(self._scratch)
        self._unflushed = False  # the sink may still read _param_staging
        self._staged = False  # this step's gradients come through the staging slots (they are on the device)
        self._device_to_host = 0
        if self._slots:
            self._grad_staging = [self._buffer(torch.float32, pin) for _ in range(2)]
            self._grad_ready = [torch.cuda.Event() for _ in range(2)]
            self._copy_stream = torch.cuda.Stream(self.device)

    # ---------------------------------------------------------------- disk tier
    def _open_files(self, directory: OffloadDirectory | str | None, total: int) -> None:
        if not directory:
            raise ConfigError("--offload-optimizer disk needs a directory for its files: pass --offload-path DIR")
        self._own_directory = isinstance(directory, str)  # a path: this store locks and creates it, and removes it
        self.directory = OffloadDirectory(directory) if self._own_directory else directory
        # O_DIRECT needs every sub-group to start on a 4096-byte boundary (one sub-group always does).
        aligned = self._count == 1 or self.group * 4 % ALIGN == 0
        io = self.offload.io if aligned else "buffered"
        try:
            if self.offload.io == "direct" and not aligned:
                raise ConfigError(f"--offload-io direct needs --offload-sub-group-numel to be a multiple of "
                                  f"{ALIGN // 4}, got {self.offload.sub_group_numel}")
            for name in self.states:
                self._files[name] = self.directory.swap_file(f"{name}.bin", total * 4, io)
        except BaseException:
            self._close_files()
            raise
        self.io_mode = "direct" if self._files["master"].direct else "buffered"

    def _bounds(self, k: int) -> tuple[int, int]:
        return k * self.group, min((k + 1) * self.group, self.numel)

    def _io_numel(self, n: int) -> int:
        """Elements one transfer moves for n: O_DIRECT rounds up to whole blocks (the file and the buffer have
        room; the bytes past the partition are zeros and stay zeros)."""
        return round_to_block(n) if self.io_mode == "direct" else n

    def _load(self, k: int, names: tuple[str, ...], buf: dict[str, torch.Tensor]) -> None:
        a, b = self._bounds(k)
        for name in names:
            self._files[name].read(4 * a, buf[name][:self._io_numel(b - a)])

    def _store(self, k: int, buf: dict[str, torch.Tensor]) -> None:
        a, b = self._bounds(k)
        for name in self.states:
            self._files[name].write(4 * a, buf[name][:self._io_numel(b - a)])

    def _write_initial(self, initial: list[torch.Tensor]) -> None:
        """Masters from `initial`, one sub-group at a time (states: the preallocated files read as zeros)."""
        buf = self._pipe.acquire()
        try:
            master = buf["master"].zero_()
            for k in range(self._count):
                a, b = self._bounds(k)
                for bucket, lo, hi in self._overlaps(self._spans, a, b):
                    off = self._offsets[bucket]
                    master[lo - a:hi - a].copy_(initial[bucket][lo - off:hi - off])
                master[b - a:].zero_()  # the O_DIRECT window past the partition: zeros
                self._files["master"].write(4 * a, master[:self._io_numel(b - a)])
        finally:
            self._pipe.release(buf)

    def _groups(self, names: tuple[str, ...] | None = None, write_back: bool = True):
        """Yields (a, b, {state: host tensor over partition elements [a, b)}) for every sub-group in order.
        Disk: read `buffer_count - 2` sub-groups ahead and written back (`write_back`) behind."""
        names = self.states if names is None else names
        if self.tier == "cpu":
            for k in range(self._count):
                a, b = self._bounds(k)
                yield a, b, {name: self._host[name][a:b] for name in names}
            return
        ahead, reads, issued = self.offload.buffer_count - 2, deque(), 0
        try:
            for k in range(self._count):
                while issued < self._count and issued <= k + ahead:
                    buf = self._pipe.acquire()
                    reads.append((buf, self._pipe.read(buf, functools.partial(self._load, issued, names))))
                    issued += 1
                buf, done = reads.popleft()
                done.result()
                a, b = self._bounds(k)
                yield a, b, {name: buf[name][:b - a] for name in names}
                if write_back:
                    self._pipe.write(buf, functools.partial(self._store, k))
                else:
                    self._pipe.release(buf)
        finally:  # also on an error in the caller: nothing of ours stays in flight
            for buf, done in reads:
                done.exception()
                self._pipe.release(buf)
            self._pipe.drain()

    # ---------------------------------------------------------------- the step
    @staticmethod
    def _overlaps(spans, a: int, b: int):
        for bucket, lo, hi in spans:
            if max(lo, a) < min(hi, b):
                yield bucket, max(lo, a), min(hi, b)

    def _copy_grads(self, grads, k: int) -> None:
        """Sub-group k's gradients device -> pinned staging slot k % 2, on the side stream (low-precision ones cast
        to fp32 there first, a piece at a time: `Fp32Buckets.piece`)."""
        a, b = self._bounds(k)
        staging = self._grad_staging[k % 2]
        with torch.cuda.stream(self._copy_stream):
            for bucket, lo, hi in self._overlaps(self._active, a, b):
                off = self._offsets[bucket]
                staging[lo - a:hi - a].copy_(_piece(grads, bucket, lo - off, hi - off), non_blocking=True)
                self._device_to_host += 4 * (hi - lo)
            self._grad_ready[k % 2].record(self._copy_stream)

    def _grad_view(self, grads, k: int, a: int, lo: int, hi: int) -> torch.Tensor:
        """Host fp32 gradients of partition elements [lo, hi) (inside one bucket, inside sub-group k at a): the
        staging slot, or the host gradients themselves (a CPU run, or gradients streamed to the host in backward);
        low-precision ones cast for the sub-group's part of the bucket (`Fp32Buckets.piece`, kept while used)."""
        if self._staged:
            return self._grad_staging[k % 2][lo - a:hi - a]
        bucket, start, end = next(o for o in self._overlaps(self._active, *self._bounds(k)) if o[1] <= lo and hi <= o[2])
        off = self._offsets[bucket]
        return _piece(grads, bucket, start - off, end - off)[lo - start:hi - start]

    def _apply(self, p, g, states: dict[str, torch.Tensor], lr: float, decay: bool) -> None:
        c = self.config
        self.rule.step(p, g, states, lr=lr, weight_decay=c.weight_decay if decay else 0.0, step=self.step_count,
                       impl=self.impl)

    def _update(self, k: int, a: int, b: int, states: dict[str, torch.Tensor], grads, lr: float) -> None:
        """The rule over the decay runs' elements in sub-group k = [a, b), window by window (`rule.windows`)."""
        p, names = states["master"], self.rule.state_names
        for run_start, run_end, decay in self._runs:
            lo, hi = max(run_start, a), min(run_end, b)
            if lo >= hi:
                continue
            for start, end in self.rule.windows(run_start, run_end, lo, hi):
                if lo <= start and end <= hi:
                    self._apply(p[start - a:end - a], self._grad_view(grads, k, a, start, end),
                                {name: states[name][start - a:end - a] for name in names}, lr, decay)
                    continue
                keep_lo, keep_hi = max(start, lo), min(end, hi)
                part, inner = slice(keep_lo - a, keep_hi - a), slice(keep_lo - start, keep_hi - start)
                sp, sg, *rows = (row[:end - start] for row in self._scratch.zero_())
                scratch = dict(zip(names, rows))
                for dst, src in ((sp, p[part]), (sg, self._grad_view(grads, k, a, keep_lo, keep_hi)),
                                 *((scratch[name], states[name][part]) for name in names)):
                    dst[inner].copy_(src)
                self._apply(sp, sg, scratch, lr, decay)
                for dst, src in ((p, sp), *((states[name], scratch[name]) for name in names)):
                    dst[part].copy_(src[inner])

    def _send(self, a: int, master: torch.Tensor, spans) -> None:
        """Parameter values of `spans` (partition coordinates, inside the sub-group at a) to the sink."""
        if self._unflushed:  # the sink may still be copying from the staging buffer
            self.sink.flush()
        for bucket, lo, hi in spans:
            values = self._param_staging[lo - a:hi - a]
            values.copy_(master[lo - a:hi - a])
            self.sink.write(bucket, lo - self._offsets[bucket], values)
            self._unflushed = True

    def _finish_sends(self) -> None:
        self.sink.flush()
        self._unflushed = False

    def step(self, grads, lr: float, grad_scale: float = 1.0) -> None:
        """grads: per bucket, fp32 gradient shards, or `Fp32Buckets` over low-precision ones; on the device (copied
        down here, sub-group by sub-group) or in host memory (read in place); scaled by `grad_scale` first."""
        scale_grads_(grads, grad_scale)
        self._drop_maps()
        self.step_count += 1
        device = grads.device if isinstance(grads, Fp32Buckets) else grads[0].device  # Fp32Buckets: also FileGrads
        self._staged = device.type == "cuda"
        if self._staged and not self._slots:
            raise RuntimeError("gradients on the device, but this store was built for host gradients (staged_grads)")
        if self._staged:
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # the gradients are ready
            self._copy_grads(grads, 0)
        for k, (a, b, states) in enumerate(self._groups()):
            if self._staged:
                self._grad_ready[k % 2].synchronize()
                if k + 1 < self._count:
                    self._copy_grads(grads, k + 1)  # slot (k+1) % 2 held k-1's gradients, used already
            self._update(k, a, b, states, grads, lr)
            self._send(a, states["master"], self._overlaps(self._active, a, b))
        self._finish_sends()

    # ---------------------------------------------------------------- the rest of the contract
    @property
    def master_bytes_per_param(self) -> int:
        return 4  # a separate fp32 copy, always (also in fp32 on a CPU run)

    def publish(self) -> None:
        self._drop_maps()
        for a, b, states in self._groups(("master",), write_back=False):
            self._send(a, states["master"], self._overlaps(self._spans, a, b))
        self._finish_sends()

    def _state(self) -> dict[str, torch.Tensor]:
        """Whole-partition fp32 tensors per state: the host tensors, or memory maps of the files.

        Maps, not copies: a checkpoint save reads and a load writes the state through them in place, so neither
        ever holds the partition in host memory (the page cache pages it). They are made on demand and dropped
        at the next step() / publish(), whose reads then see what was written through them (the maps and
        pread/pwrite, O_DIRECT included, share one coherent view of the file on Linux). They map the descriptors
        opened at construction, never the files' paths."""
        if self.tier == "cpu":
            return self._host
        if self._maps is None:
            self._maps = {name: f.map(self.numel, torch.float32) for name, f in self._files.items()}
        return self._maps

    def _drop_maps(self) -> None:
        self._maps = None

    def masters(self) -> list[torch.Tensor]:
        """Per bucket, views of the master slice (host tensors or file maps; valid until the next step)."""
        master = self._state()["master"]
        return [master[off:end] for _, off, end in self._spans]

    def owned_pieces(self) -> list[OwnedPiece]:
        state, pieces = self._state(), []
        for off, layout in zip(self._offsets, self.layouts):
            for i, start, end in layout.owned_pieces():
                first = layout.shard_start + start - layout.offsets[i]  # where the piece begins in the parameter
                tensors = {name: state[name][off + start:off + end] for name in self.states}
                pieces.append(OwnedPiece(layout.names[i], layout.shapes[i], first, first + end - start, tensors))
        return pieces

    def held_tensors(self) -> list[torch.Tensor]:
        return []  # nothing on the device

    def tier_bytes(self) -> TierBytes:
        host = sum(t.untyped_storage().nbytes() for t in self._host.values()) if self.tier == "cpu" else 0
        return TierBytes(host=host, host_buffers=sum(t.untyped_storage().nbytes() for t in self._buffers),
                         disk=sum(f.nbytes for f in self._files.values()))

    def host_buffer_formula(self) -> tuple[int, str]:
        """(bytes, text) of this store's host buffers: `sizing.buffer_formula`."""
        return buffer_formula(self.offload, self.numel, self.cuda, self.sink.dtype.itemsize, self.rule, self._slots)

    def transfers(self) -> Transfers:
        return Transfers(device_to_host=self._device_to_host, host_to_device=self.sink.transfers().host_to_device,
                         disk_read=sum(f.bytes_read for f in self._files.values()),
                         disk_written=sum(f.bytes_written for f in self._files.values()))

    def check_files(self) -> None:
        for f in self._files.values():
            f.check()

    def _close_files(self) -> None:
        for f in self._files.values():
            f.close(remove=True)
        self._files = {}
        if self._own_directory:
            self.directory.close()

    def close(self) -> None:
        self._drop_maps()
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None
        self._close_files()
