"""This rank's private folder for its swap files under --offload-path, and the lock that says whose it is.

    PATH/rank00000.lock   flock'ed by this run's rank 0 while it runs; holds its pid (removed at close)
    PATH/rank00000/       made by this run with os.mkdir (mode 0700) once it holds the lock; every swap file is
                          created in it through the folder's descriptor with O_CREAT | O_EXCL | O_NOFOLLOW

Why: two runs given the same --offload-path used to truncate and delete each other's live files, and a symlink
planted where a swap file goes was followed. A second run on a locked path is refused in one line naming the
holder's pid, not given a subfolder of its own: the two would share the disk's space and bandwidth, which the
space check at start cannot promise, so it is said at once. A folder left by a run that died (its lock is free,
so its holder is gone) is removed when it holds only swap files by mpzero's names, with a note; anything else
in it is refused, never deleted. Nothing here re-opens a path once created: the files are used through their
descriptors (`SwapFile`), so a folder renamed or replaced under the run is not followed either.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import stat
import threading

from mpzero.errors import ConfigError
from mpzero.optim import STATE_NAMES
from mpzero.launcher_env import launcher_env
from mpzero.zero.offload.swap import SwapFile, readable

# every file a store creates: the masters and each update rule's states, stage 3's parameters, the gradients
SWAP_NAMES = ("master.bin", *(f"{name}.bin" for name in STATE_NAMES), "params.swap", "grads.bin")


class OffloadDirectory:
    """`path` (e.g. PATH/rank00000) locked, created fresh and private; `swap_file(name, ...)` creates files in
    it; `close()` removes the folder (once its files are closed and removed) and the lock."""

    def __init__(self, path: str):
        self.path, self.lock_path = os.path.abspath(path), os.path.abspath(path) + ".lock"
        self.note: str | None = None  # what was cleaned up from a dead run, to be said once
        self.fd = None
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)  # --offload-path itself
        except OSError as error:
            raise ConfigError(f"cannot create the offload path {os.path.dirname(self.path)} "
                              f"({error.strerror or error}): choose a writable --offload-path") from None
        self._lock_fd = _take_lock(self.lock_path, self.path)
        # Ignored, SIGXFSZ lets a file-size limit (ulimit -f) surface as EFBIG, one line, instead of a core dump.
        self._xfsz = None
        if threading.current_thread() is threading.main_thread():
            self._xfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        try:
            self._remove_stale()
            os.mkdir(self.path, 0o700)
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as error:
            self.close()
            raise ConfigError(f"cannot create the offload folder {self.path} ({error.strerror or error}): choose a "
                              f"writable --offload-path") from None
        except BaseException:
            self.close()
            raise

    def swap_file(self, name: str, nbytes: int, io: str) -> SwapFile:
        return SwapFile(os.path.join(self.path, name), nbytes, io, dir_fd=self.fd)

    def _remove_stale(self) -> None:
        """A folder at `path` although we hold its lock: left by a run that died. Removed if it is a folder of
        this user holding only swap files by our names; refused otherwise."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        advice = "remove it yourself if it is not needed, or choose another --offload-path"
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise ConfigError(f"{self.path} exists and is not an offload folder of this user (a "
                              f"{'symlink' if stat.S_ISLNK(st.st_mode) else 'file or foreign folder'}): {advice}")
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            names = os.listdir(fd)
            foreign = sorted(set(names) - set(SWAP_NAMES))
            if foreign:
                raise ConfigError(f"{self.path} was left by a run that died (its lock is free) but holds "
                                  f"{foreign[0]!r}, which mpzero does not create: {advice}")
            for name in names:
                os.unlink(name, dir_fd=fd)  # a symlink by one of our names: the link goes, its target stays
        finally:
            os.close(fd)
        os.rmdir(self.path)
        self.note = (f"note: removed {self.path} ({len(names)} swap files), left by an offloaded run that died "
                     f"(its lock {self.lock_path} was free)")

    def close(self) -> None:
        """Remove the folder (left in place if something else was put in it) and release the lock."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            try:
                os.rmdir(self.path)
            except OSError:
                pass
        if self._lock_fd is not None:
            try:  # while still holding the lock: a run waiting on this file finds it gone and takes a new one
                if _same_file(self.lock_path, self._lock_fd):
                    os.unlink(self.lock_path)
            finally:
                os.close(self._lock_fd)
                self._lock_fd = None
        if self._xfsz is not None:
            signal.signal(signal.SIGXFSZ, self._xfsz)
            self._xfsz = None


def _take_lock(lock_path: str, folder: str) -> int:
    """An exclusive flock on `lock_path` (created if missing, never through a symlink), with our pid in it."""
    while True:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as error:
            what = "is a symlink" if error.errno == errno.ELOOP else f"cannot be opened ({error.strerror})"
            raise ConfigError(f"the offload lock file {lock_path} {what}: choose another --offload-path") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(f"another run (pid {holder}) is using the offload folder {folder}: wait for it to "
                              f"end, or give this run its own --offload-path") from None
        if _same_file(lock_path, fd):  # else its holder removed it as we opened it: take the new one
            break
        os.close(fd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_nlink != 1:
        os.close(fd)
        raise ConfigError(f"the offload lock file {lock_path} is not a plain file of this user: remove it "
                          f"yourself if no run uses it, or choose another --offload-path")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _same_file(path: str, fd: int) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def open_offload_directory(offload, stage: int, world, dp_size: int, numel: int, p: int, g: int,
                           states: int) -> OffloadDirectory:
    """The disk tier's folder of this rank, PATH/rank00000 (by `world` rank), locked and created fresh, once every
    rank has its own and room for its files (`OffloadConfig` offload, ZeRO over `dp_size` ranks); a failure on any
    rank is a ConfigError on all, with nothing left behind."""

    def open_checked() -> OffloadDirectory:
        directory = OffloadDirectory(os.path.join(offload.path, f"rank{world.rank:05d}"))
        try:
            _check_offload_space(offload, stage, directory, numel, dp_size, p, g, states)
        except BaseException:
            directory.close()
            raise
        return directory

    directory, error = world.run_agreed(open_checked, (ConfigError, OSError))
    if error:
        if directory is not None:
            directory.close()
        raise ConfigError(error)
    return directory


def _check_offload_space(offload, stage: int, directory: OffloadDirectory, numel: int, dp_size: int, p: int, g: int,
                         states: int) -> None:
    """Before any file is written: the file system of this rank's folder has room for the disk tier's files of
    every rank sharing it (LOCAL_WORLD_SIZE ranks on this machine)."""
    per_param = (4 + states if offload.optimizer == "disk" else 0) + (p if offload.params == "disk" else 0)
    per_param += g if offload.grads_tier(stage) == "disk" else 0
    need = per_param * -(-numel // dp_size) * launcher_env().local_world_size
    st = os.fstatvfs(directory.fd)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise ConfigError(f"--offload-path {offload.path} has {readable(free)} free, the disk tier needs "
                          f"{readable(need)} on this machine: free space or choose another --offload-path")
