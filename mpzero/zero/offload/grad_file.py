"""The gradient partition on disk (ZeRO-Infinity: with the optimizer's states on NVMe, the gradients go there too):
this rank's reduced gradient slice of every bucket (stage 3: unit) in one file, in the gradients' dtype, each
bucket's slice in its own 4096-byte aligned region, so that every transfer is one whole aligned region (O_DIRECT
where the file system allows).

Backward (`ShardedGrads`, stages 2-3 with `--offload-optimizer disk`): each reduced slice lands in a host buffer
(`buffers[0]`: on CUDA the pinned landing buffer of the device-to-host copy) and is written to its region on the
I/O thread while backward goes on (`write_behind`; the buffers are touched again only after `wait()`); a later
micro-batch reads the region into `buffers[1]`, adds the new slice and writes it back (the same additions, in the
same order, as the slices kept in memory: bitwise). The step (`FileGrads`, step_grads.py) reads the regions back in
bucket order through `RegionReader`, the next region read ahead on an I/O thread into the other buffer.

Host memory: the two region buffers, each the largest region (`host_buffer_formula`), whatever the model size;
the file holds g x (this rank's partition) plus each region's alignment.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from mpzero.errors import ConfigError
from mpzero.zero.offload.directory import OffloadDirectory
from mpzero.zero.offload.swap import ALIGN, aligned_bytes, aligned_empty, round_up

FILE_NAME = "grads.bin"


def gradient_file(offload, stage: int, directory, layouts, dtype: torch.dtype, device) -> GradFile | None:
    """The gradient file of a stage's `layouts` when `offload` puts its gradients on disk, else None. `directory`:
    the run's `OffloadDirectory` (the one ZeroOptimizer opens for the disk tier)."""
    if offload is None or offload.grads_tier(stage) != "disk":
        return None
    if not isinstance(directory, OffloadDirectory):
        raise ConfigError("gradients on disk need the disk tier's folder (an OffloadDirectory, as ZeroOptimizer "
                          "opens under --offload-path)")
    pin = offload.pin_memory and torch.device(device).type == "cuda"
    return GradFile(directory, [layout.shard_numel for layout in layouts], dtype, offload.io, pin)


def gradient_file_bytes(numels: list[int], dtype: torch.dtype) -> tuple[list[int], int]:
    """(bytes of each bucket's 4 KiB-aligned region, host bytes of the two region buffers): what a `GradFile` of
    these slices allocates (the planner's figures are these)."""
    regions = [round_up(dtype.itemsize * n) for n in numels]
    return regions, 2 * aligned_bytes(max(regions, default=0) // dtype.itemsize, dtype)


class GradFile:
    """This rank's gradient slices (`numels[b]` elements of `dtype` for bucket b) in one file of `directory`."""

    def __init__(self, directory: OffloadDirectory, numels: list[int], dtype: torch.dtype, io: str,
                 pin: bool = False):
        self.numels, self.dtype = list(numels), dtype
        self.regions, self._buffer_bytes = gradient_file_bytes(self.numels, dtype)  # each bucket's region
        self.offsets, total = [], 0
        for region in self.regions:
            self.offsets.append(total)
            total += region
        capacity = max(self.regions, default=0) // dtype.itemsize
        self.file = directory.swap_file(FILE_NAME, total, io)
        try:
            self.buffers = [aligned_empty(capacity, dtype, pin) for _ in range(2)]
        except BaseException:
            self.file.close(remove=True)
            raise
        self._io = ThreadPoolExecutor(1, thread_name_prefix="mpzero-grad-io")
        self._writing: Future | None = None

    def _region_view(self, buffer: torch.Tensor, bucket: int) -> torch.Tensor:
        """The whole region of `bucket` in `buffer` (its slice and the alignment tail past it)."""
        return buffer[:self.regions[bucket] // self.dtype.itemsize]

    def write(self, bucket: int, buffer: torch.Tensor) -> None:
        """Bucket's slice, held at the start of `buffer` (one of `buffers`), to its region, whole."""
        self.file.write(self.offsets[bucket], self._region_view(buffer, bucket))

    def write_behind(self, bucket: int, buffer: torch.Tensor) -> None:
        """`write` on the I/O thread; `wait()` before `buffer` is changed or read into again."""
        self.wait()
        self._writing = self._io.submit(self.write, bucket, buffer)

    def wait(self) -> None:
        """The write behind, if any, is done (its error raised here)."""
        if self._writing is not None:
            writing, self._writing = self._writing, None
            writing.result()

    def read(self, bucket: int, buffer: torch.Tensor) -> torch.Tensor:
        """Bucket's slice from its region into `buffer` (one of `buffers`); returns the slice's view."""
        self.file.read(self.offsets[bucket], self._region_view(buffer, bucket))
        return buffer[:self.numels[bucket]]

    def reader(self) -> RegionReader:
        return RegionReader(self)

    @property
    def nbytes(self) -> int:
        return self.file.nbytes

    def host_buffer_formula(self) -> tuple[int, str]:
        """(bytes, text) of the two region buffers: each the largest region R + 4 KiB of alignment slack."""
        return self._buffer_bytes, f"2x(R+{ALIGN // 1024}KiB)"

    def check(self) -> None:
        self.wait()
        self.file.check()

    def close(self) -> None:
        if self._writing is not None:
            self._writing.exception()  # the run is being torn down: its error, if any, was not the first
        self._io.shutdown(wait=True)
        self.file.close(remove=True)


class RegionReader:
    """The step's reads, in bucket order: `slice(b)` returns bucket b's slice in one of the two buffers (read
    ahead when b follows the previous bucket, else read now) and starts reading the next bucket into the other.
    A slice stays valid until the bucket after the next is asked for."""

    def __init__(self, grads: GradFile):
        grads.wait()  # backward's last write is in the file
        self._grads = grads
        self._current: tuple[int, int] | None = None  # (bucket, buffer index)
        self._ahead: tuple[int, int, Future] | None = None  # (bucket, buffer index, its read)

    def slice(self, bucket: int) -> torch.Tensor:
        if self._current is not None and self._current[0] == bucket:
            return self._grads.buffers[self._current[1]][:self._grads.numels[bucket]]
        if self._ahead is not None and self._ahead[0] == bucket:
            _, index, read = self._ahead
            self._ahead = None
            read.result()
        else:
            self.wait()  # a read ahead of another bucket may still fill a buffer
            index = 0 if self._current is None else 1 - self._current[1]
            self._grads.read(bucket, self._grads.buffers[index])
        self._current = (bucket, index)
        if bucket + 1 < len(self._grads.numels):
            other = 1 - index
            self._ahead = (bucket + 1, other, self._grads._io.submit(self._grads.read, bucket + 1,
                                                                      self._grads.buffers[other]))
        return self._grads.buffers[index][:self._grads.numels[bucket]]

    def wait(self) -> None:
        """No read in flight (before the buffers are used for anything else): errors of an unused read ahead are
        raised here."""
        if self._ahead is not None:
            read, self._ahead = self._ahead[2], None
            read.result()
