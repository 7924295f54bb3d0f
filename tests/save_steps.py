"""A save's file-system steps, recorded and stopped (tests/test_checkpoint_protocol.py): `FileSystem` counts each
file's creation and first two writes, each fsync, rename, mkdir and deletion, and from step `crash_at` on makes
every one raise `Crash`, the way a kill stops a save; it also keeps what a power cut would lose (what was written
but not yet fsynced)."""

import builtins
import io
import os
import stat
from collections import Counter

from mpzero.checkpointing import LATEST


class Crash(BaseException):
    """The process is gone at this step: not an Exception, so no `except Exception` handler runs."""


class FileSystem:
    """Counts the save's file-system steps; from step `crash_at` on each raises Crash before it happens. Keeps
    a model of what a power cut would lose: (directory inode, name) entries and file inodes not yet fsynced."""

    def __init__(self, monkeypatch, root, crash_at=None):
        self.root, self.crash_at, self.steps, self.kinds, self.trace = root, crash_at, 0, Counter(), []
        self.dirty_entries, self.dirty_files, self.unsynced_publications = set(), set(), []
        real = {name: getattr(os, name) for name in ("replace", "rename", "mkdir", "unlink", "remove", "rmdir",
                                                      "fsync", "open")}
        real_open = builtins.open

        def step(kind, *paths):
            self.steps += 1
            if self.crash_at is not None and self.steps >= self.crash_at:
                raise Crash(f"step {self.steps}: {kind}")
            self.kinds[kind] += 1
            self.trace.append(kind)
            for path in paths:  # a directory entry this step changes
                parent, name = os.path.split(os.path.abspath(path))
                self.dirty_entries.add((os.stat(parent).st_ino, name))

        def rename(kind):
            def renamed(src, dst, *args, **kwargs):
                step(kind, src, dst)
                if os.path.abspath(dst) == os.path.join(self.root, LATEST):
                    self.unsynced_publications.append(self._unsynced(src))
                real[kind](src, dst, *args, **kwargs)
                if os.path.abspath(dst) == os.path.join(self.root, LATEST):
                    self.trace.append("pointer renamed")
                elif os.path.basename(dst)[len("iter_"):].isdigit():
                    self.trace.append("directory renamed")
            return renamed

        def deleting(kind):  # shutil.rmtree passes dir_fd: a deletion's entry is never read again
            def deleted(path, *args, **kwargs):
                step(kind)
                return real[kind](path, *args, **kwargs)
            return deleted

        def mkdir(path, *args, **kwargs):
            step("mkdir", path)
            return real["mkdir"](path, *args, **kwargs)

        def fsync(fd):
            step("fsync")
            info = os.fstat(fd)
            if stat.S_ISDIR(info.st_mode):
                self.dirty_entries = {(ino, name) for ino, name in self.dirty_entries if ino != info.st_ino}
            self.dirty_files.discard(info.st_ino)
            return real["fsync"](fd)

        def open_(file, mode="r", *args, **kwargs):
            writing = any(c in mode for c in "wax+")
            if writing and isinstance(file, int) and self._inside(os.readlink(f"/proc/self/fd/{file}")):
                return Written(real_open(file, mode, *args, **kwargs), step, self.dirty_files)  # os_open's step
            if not writing or not isinstance(file, (str, os.PathLike)) or not self._inside(file):
                return real_open(file, mode, *args, **kwargs)
            step("open", file)
            return Written(real_open(file, mode, *args, **kwargs), step, self.dirty_files)

        def os_open(path, flags, *args, **kwargs):  # mpzero's writer creates its temporary files so
            if flags & os.O_CREAT and kwargs.get("dir_fd") is None and self._inside(path):
                step("open", path)
            return real["open"](path, flags, *args, **kwargs)

        for kind in ("replace", "rename"):
            monkeypatch.setattr(os, kind, rename(kind))
        for kind in ("unlink", "remove", "rmdir"):
            monkeypatch.setattr(os, kind, deleting(kind))
        monkeypatch.setattr(os, "mkdir", mkdir)
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "open", os_open)
        monkeypatch.setattr(builtins, "open", open_)
        monkeypatch.setattr(io, "open", open_)  # pathlib's, DCP's

    def _inside(self, path) -> bool:
        return os.path.abspath(path).startswith(self.root)

    def _unsynced(self, pointer_tmp):
        """What a power cut right after the pointer's rename could lose of the checkpoint it will name."""
        with builtins.open(pointer_tmp) as f:
            directory = os.path.join(self.root, f"iter_{int(f.read()):07d}")
        lost = [p for p in [pointer_tmp] if os.stat(p).st_ino in self.dirty_files]
        for path in [directory] + [os.path.join(d, n) for d, ds, fs in os.walk(directory) for n in ds + fs]:
            parent, name = os.path.split(path)
            if (os.stat(parent).st_ino, name) in self.dirty_entries or os.stat(path).st_ino in self.dirty_files:
                lost.append(path)
        return lost


class Written:
    """A file being written: each write reaches the OS at once (a kill loses no buffer). Its first two writes are
    steps (stopped there: the file is empty, or holds a part); the state after its last one is the next step's."""

    def __init__(self, file, step, dirty_files):
        self._file, self._step, self._dirty, self._writes = file, step, dirty_files, 0

    def write(self, data):
        self._writes += 1
        if self._writes <= 2:
            self._step("write")
        written = self._file.write(data)
        self._file.flush()
        self._dirty.add(os.fstat(self._file.fileno()).st_ino)
        return written

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()
