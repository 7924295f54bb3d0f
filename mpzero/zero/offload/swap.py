"""Aligned host buffers and swap files for the disk tier (ZeRO-Infinity's NVMe offload, without libaio).

- `aligned_empty(numel, dtype, pin)`: a CPU tensor at a 4096-byte aligned address (O_DIRECT needs it).
- `SwapFile(path, nbytes, io, dir_fd)`: one preallocated file, created exclusively (never over an existing file or
  through a symlink) and used only through its descriptor, read and written at byte offsets from CPU tensors with
  `os.preadv` / `os.pwritev` (they release the GIL, so reader and writer threads overlap with compute).
  io "direct" opens it with O_DIRECT (bypasses the page cache: the file's bytes never double as host memory),
  "buffered" never does, "auto" tries O_DIRECT and falls back where the file system refuses it.
- `SwapPipeline(buffers)`: one reader and one writer thread over a fixed set of buffers: read the next item
  while the current one is computed and the previous one written. No buffer is ever allocated by it.

Disk-full, quota, file-size-limit and O_DIRECT refusals are one-line `ConfigError`s (at construction) or
`TrainingError`s (a write during training) that name the path, the real cause (ENOSPC, EDQUOT or EFBIG), the
bytes needed and free in readable units, and the flag to change. A file deleted or cut short by another process
while the run holds it is a one-line `TrainingError` at its next transfer or `check()`.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import resource
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from mpzero.errors import ConfigError, TrainingError
from mpzero.zero.config import DIRECT_IO_ALIGN as ALIGN


def round_up(nbytes: int, align: int = ALIGN) -> int:
    return -(-nbytes // align) * align


def aligned_bytes(numel: int, dtype: torch.dtype) -> int:
    """Host bytes `aligned_empty(numel, dtype, ...)` allocates: the payload rounded up to 4096, plus 4096 of
    slack to find an aligned start (the CPU allocator only guarantees 64-byte alignment)."""
    return round_up(numel * _itemsize(dtype)) + ALIGN


def aligned_empty(numel: int, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
    """A 1-D CPU tensor of `numel` elements whose data pointer is a multiple of 4096 and whose room (the bytes
    from its start to its storage's end) is `numel * itemsize` rounded up to 4096. Page-locked only when `pin`
    and CUDA is available. Its storage holds `aligned_bytes(numel, dtype)` bytes."""
    nbytes = round_up(numel * _itemsize(dtype))
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin and torch.cuda.is_available())
    start = -raw.data_ptr() % ALIGN
    return raw[start:start + nbytes].view(dtype)[:numel]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's bytes (any dtype; no copy)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"swap I/O needs a contiguous CPU tensor, got {tensor.device} "
                         f"{'contiguous' if tensor.is_contiguous() else 'strided'}")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def readable(nbytes: int) -> str:
    """Bytes for a person: "512 bytes", "8.0 KiB", "300.0 MiB" (below a GiB), "12.34 GiB"."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{nbytes} bytes"


def disk_error_message(path: str, needed: int, code: int, free: int) -> str:
    """One line for a file that could not grow: the real cause (a full disk, a quota, or a file-size limit), the
    bytes needed and available, and what to change."""
    if code == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            return (f"the offload file {path} needs {readable(needed)}, over this process's file-size limit of "
                    f"{readable(limit)} (EFBIG: RLIMIT_FSIZE, `ulimit -f`): raise the limit")
        return (f"the offload file {path} needs {readable(needed)}, larger than its file system allows for one "
                f"file (EFBIG): pass another --offload-path")
    cause = "the disk quota is exceeded (EDQUOT)" if code == errno.EDQUOT else "no space left on the device (ENOSPC)"
    return (f"the offload file {path} needs {readable(needed)} and {cause}: {readable(free)} free there; free "
            f"space or pass another --offload-path")


GROW_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a file that cannot grow: disk full, quota, size limit


class SwapFile:
    """A file of `nbytes` (rounded up to 4096) created exclusively (never through a symlink, never over an
    existing file: O_CREAT | O_EXCL | O_NOFOLLOW, in the folder `dir_fd` when given) and preallocated, then read
    and written only through the descriptor opened here, at byte offsets from contiguous CPU tensors.

    With O_DIRECT (`self.direct`), a transfer whose offset, length and buffer address are all multiples of 4096
    goes straight between the tensor and the file. Any other range goes through an aligned window: the 4096-byte
    blocks the range touches. A read reads the window and copies the range out; a write reads the window's first
    and last block (where the range covers them only in part), puts the range in, and writes the whole window
    back (the bytes outside the range keep their values, so two unaligned writes sharing a block must not run
    at the same time). Without O_DIRECT every transfer is exactly the range. `bytes_read` / `bytes_written`
    count what went to or from the file, windows included.

    Every transfer first checks (one fstat) that the file was neither deleted nor shrunk by someone else; so does
    `check()`, before a checkpoint reads the state. Reads and writes of disjoint ranges may run in different
    threads at once; `close()` is idempotent. A failed construction removes the file it created.
    """

    def __init__(self, path: str, nbytes: int, io: str = "auto", dir_fd: int | None = None):
        if io not in ("auto", "direct", "buffered"):
            raise ConfigError(f"--offload-io {io!r} is not one of auto, direct, buffered")
        self.path, self.nbytes = path, round_up(nbytes)
        self.bytes_read = self.bytes_written = 0
        self._lock = threading.Lock()  # the counters are bumped from reader and writer threads
        self._name, self._dir_fd = (os.path.basename(path), dir_fd) if dir_fd is not None else (path, None)
        self._fd = self._create()
        self._identity = os.fstat(self._fd)
        try:
            self.direct = io != "buffered" and hasattr(os, "O_DIRECT") and self._try_direct(io == "direct")
            if not self.direct:
                self._allocate()
        except BaseException:
            self.close(remove=True)
            raise

    def _create(self) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return os.open(self._name, flags, 0o600, dir_fd=self._dir_fd)
        except OSError as error:
            if error.errno == errno.EEXIST:  # also a symlink by that name: O_EXCL never follows one
                raise ConfigError(f"the offload file {self.path} already exists (this run did not create it; "
                                  f"it is left untouched): remove it or choose another --offload-path") from None
            raise ConfigError(f"cannot create the offload file {self.path} ({error.strerror}): choose a writable "
                              f"--offload-path") from None

    def _allocate(self) -> None:
        if not self.nbytes:
            return
        try:
            os.posix_fallocate(self._fd, 0, self.nbytes)
        except OSError as error:
            if error.errno in GROW_ERRORS:
                raise ConfigError(self._grow_message(self.nbytes, error.errno)) from None
            raise

    def _grow_message(self, needed: int, code: int) -> str:
        try:
            st = os.fstatvfs(self._fd)
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = 0
        return disk_error_message(self.path, needed, code, free)

    def _set_direct(self, on: bool) -> None:
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)

    def _try_direct(self, required: bool) -> bool:
        """Turn O_DIRECT on for the descriptor and prove it with one aligned write (some file systems accept the
        flag and refuse the I/O). Returns False to fall back (io auto); raises for io direct."""
        try:
            self._set_direct(True)
            self._allocate()
            probe = aligned_empty(ALIGN, torch.uint8).zero_()
            os.pwritev(self._fd, [_bytes_view(probe)], 0)  # the file is fresh: its first block is zeros anyway
            return True
        except OSError as error:
            if error.errno in GROW_ERRORS:  # the probe's write
                raise ConfigError(self._grow_message(ALIGN, error.errno)) from None
            if error.errno != errno.EINVAL:
                raise
            self._set_direct(False)
            if required:
                raise ConfigError(f"--offload-io direct: the file system of {self.path} refuses O_DIRECT (e.g. "
                                  f"tmpfs or an overlay file system); pass --offload-io buffered or auto, or "
                                  f"another --offload-path") from None
            return False

    def check(self) -> None:
        """One line when someone else deleted the file or cut it short while this run holds it (its state is gone
        or was never going to be saved from it)."""
        st = os.fstat(self._fd)
        if st.st_nlink == 0:
            raise TrainingError(f"the offload file {self.path} was deleted by another process while this run used "
                                f"it: stopped, no checkpoint saved from it; keep --offload-path to this run alone")
        if st.st_size < self.nbytes:
            raise TrainingError(f"the offload file {self.path} was cut to {st.st_size} of its {self.nbytes} bytes "
                                f"by another process while this run used it: stopped, no checkpoint saved from it; "
                                f"keep --offload-path to this run alone")

    def map(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The first `numel` elements of the file as a tensor sharing its pages (a shared memory map of the held
        descriptor: writes through it reach the file; coherent with this object's reads and writes)."""
        self._check_open()
        self.check()
        if not numel:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(mmap.mmap(self._fd, self.nbytes), dtype=dtype, count=numel)

    def read(self, offset: int, out: torch.Tensor) -> None:
        """Bytes [offset, offset + out.nbytes) of the file into `out` (contiguous, on the CPU)."""
        self._check_range(offset, out)
        if self._aligned(offset, out):
            self._transfer(os.preadv, offset, _bytes_view(out))
            return
        lo, hi = offset // ALIGN * ALIGN, round_up(offset + out.nbytes)
        window = aligned_empty(hi - lo, torch.uint8)
        self._transfer(os.preadv, lo, _bytes_view(window))
        out.reshape(-1).view(torch.uint8).copy_(window[offset - lo:offset - lo + out.nbytes])

    def write(self, offset: int, values: torch.Tensor) -> None:
        """`values` (contiguous, on the CPU) into bytes [offset, offset + values.nbytes) of the file."""
        self._check_range(offset, values)
        if self._aligned(offset, values):
            self._transfer(os.pwritev, offset, _bytes_view(values))
            return
        end = offset + values.nbytes
        lo, hi = offset // ALIGN * ALIGN, round_up(end)
        window = aligned_empty(hi - lo, torch.uint8)
        if offset != lo:  # the first block keeps its bytes before the range
            self._transfer(os.preadv, lo, _bytes_view(window[:ALIGN]))
        if end != hi and (hi - ALIGN != lo or offset == lo):  # the last block keeps its bytes after the range
            self._transfer(os.preadv, hi - ALIGN, _bytes_view(window[-ALIGN:]))
        window[offset - lo:end - lo].copy_(values.reshape(-1).view(torch.uint8))
        self._transfer(os.pwritev, lo, _bytes_view(window))

    def _check_open(self) -> None:
        if self._fd is None:
            raise ValueError(f"the offload file {self.path} is closed")

    def _check_range(self, offset: int, tensor: torch.Tensor) -> None:
        self._check_open()
        if offset < 0 or offset + tensor.nbytes > self.nbytes:
            raise ValueError(f"bytes [{offset}, {offset + tensor.nbytes}) lie outside the offload file {self.path} "
                             f"of {self.nbytes} bytes")

    def _aligned(self, offset: int, tensor: torch.Tensor) -> bool:
        return not self.direct or (offset % ALIGN == 0 and tensor.nbytes % ALIGN == 0
                                   and tensor.data_ptr() % ALIGN == 0)

    def _transfer(self, call: Callable, offset: int, view: memoryview) -> None:
        """preadv/pwritev until every byte moved (both may stop short), after checking the file is still ours
        whole (a pwrite past a cut would silently grow it back with zeros)."""
        self.check()
        done = 0
        while done < len(view):
            try:
                n = call(self._fd, [view[done:]], offset + done)
            except OSError as error:
                if error.errno in GROW_ERRORS:
                    raise TrainingError(self._grow_message(len(view) - done, error.errno)) from None
                raise
            if n == 0:  # cannot happen within the preallocated size; never spin
                raise TrainingError(f"the offload file {self.path} ended at byte {offset + done} of {self.nbytes}: "
                                    f"was it truncated? (--offload-path)")
            done += n
        with self._lock:
            if call is os.preadv:
                self.bytes_read += done
            else:
                self.bytes_written += done

    def close(self, remove: bool = False) -> None:
        """Close the descriptor; `remove`: unlink the file, if its name still names the file created here."""
        if self._fd is None:
            return
        try:
            if remove:
                try:
                    st = os.stat(self._name, dir_fd=self._dir_fd, follow_symlinks=False)
                    if (st.st_dev, st.st_ino) == (self._identity.st_dev, self._identity.st_ino):
                        os.unlink(self._name, dir_fd=self._dir_fd)
                except FileNotFoundError:
                    pass
        finally:
            os.close(self._fd)
            self._fd = None


class SwapPipeline:
    """Read ahead, write behind: one reader thread, one writer thread, a fixed list of buffers.

        pipe = SwapPipeline(buffers)
        buf = pipe.acquire()                 # a free buffer (waits for the oldest write when none is free)
        done = pipe.read(buf, load)          # load(buf) runs on the reader thread; done.result() waits
        ...compute in buf...
        pipe.write(buf, store)               # store(buf) runs on the writer thread, then buf is free again
        pipe.release(buf)                    # or: give it back without writing
        pipe.drain()                         # every write done (raises the first error of any)

    Reads run one at a time in submission order, writes likewise; a read and a write run at once, so they must
    touch different file ranges. Only one thread (the caller's) may call these methods.
    """

    def __init__(self, buffers: list[Any]):
        self.buffers = list(buffers)
        self._free = deque(self.buffers)
        self._writes: deque[tuple[Future, Any]] = deque()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="mpzero-swap-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="mpzero-swap-write")

    def acquire(self) -> Any:
        while not self._free:
            if not self._writes:
                raise RuntimeError(f"all {len(self.buffers)} swap buffers are held: release or write one first")
            self._retire()
        return self._free.popleft()

    def read(self, buffer: Any, load: Callable[[Any], None]) -> Future:
        return self._reader.submit(load, buffer)

    def write(self, buffer: Any, store: Callable[[Any], None]) -> None:
        self._writes.append((self._writer.submit(store, buffer), buffer))

    def release(self, buffer: Any) -> None:
        self._free.append(buffer)

    def drain(self) -> None:
        while self._writes:
            self._retire()

    def _retire(self) -> None:
        future, buffer = self._writes.popleft()
        self._free.append(buffer)  # back in the pool even when the write failed: the error is raised here
        future.result()

    def close(self) -> None:
        """Wait for what is queued (errors ignored: the store is being torn down) and stop the threads."""
        for future, _ in self._writes:
            future.exception()
        self._writes.clear()
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
