"""Files that are either complete or absent: write to a temporary name beside the target, flush and fsync,
then rename over the target (atomic on POSIX) and fsync the directory so the rename itself is durable.
A crash at any moment leaves the old file (or none) and at most a `*.tmp*` file, never a half-written target.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from typing import BinaryIO, Callable, Iterator

from mpzero.errors import ConfigError


def check_output_directory(path: str, flag: str) -> None:
    """At start: `path` is a directory this process can write (created if missing), else one ConfigError line
    naming `flag`, instead of a failure after the first hours of work."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as error:
        raise ConfigError(f"{flag} {path} is not a writable directory ({error.strerror or error}): "
                          f"choose a directory this run can write") from None


def check_parents_creatable(path: str, flag: str) -> None:
    """At start: `path` can be made where it is: its nearest existing ancestor is a directory this process can write
    (the missing ones between are made when it is written, by `make_parents`), else one ConfigError line."""
    ancestor = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor) or not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path} cannot be created ({ancestor} is not a writable directory): choose a path "
                          f"this run can write")


def make_parents(path: str) -> None:
    """The missing directories above `path` (an output's), with the user's usual permissions (umask)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def give_usual_mode(path: str) -> None:
    """Give the file `path` the mode `open()` gives a new file (0666 less the umask), as every other file a tool
    writes has: for files a library creates with a mode of its own (safetensors' 0600)."""
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    try:  # Linux states it; os.umask can only be read by setting it, which races with other threads
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def fsync_directory(path: str) -> None:
    """Make a rename or creation inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on directories
    finally:
        os.close(fd)


def publish_file(tmp: str, path: str) -> None:
    """Rename the complete, closed file `tmp` to `path`, its bytes and the rename made durable."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_directory(os.path.dirname(os.path.abspath(path)))


@contextlib.contextmanager
def atomic_open(path: str, suffix: str = ".tmp") -> Iterator[BinaryIO]:
    """`with atomic_open(path) as f: f.write(...)`: `path` appears complete when the block ends without an
    exception; on one, the temporary file is removed and `path` is untouched."""
    tmp = path + suffix
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    fsync_directory(os.path.dirname(os.path.abspath(path)))


def write_atomically(path: str, data: bytes | str | Callable[[BinaryIO], None]) -> None:
    """Write bytes, text (UTF-8) or whatever `data(file)` writes to `path`, atomically."""
    with atomic_open(path) as f:
        if callable(data):
            data(f)
        else:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)


def replace_directory(tmp: str, final: str) -> None:
    """Rename the complete directory `tmp` to `final`, each rename made durable (the parent fsynced after it).
    An existing `final` (the same iteration saved again) is renamed aside to `final + ".old"` first and deleted
    only after, so at every moment `final` or `final.old` holds a complete copy (readers take `.old` while `final`
    is missing: checkpointing/format.py published_dir). An `.old` beside a complete `final` is garbage; an `.old`
    without `final` (a replacement cut short between its renames) is the only copy and is kept until `tmp` has
    taken its place."""
    old = final + ".old"  # checkpointing/format.py OLD_SUFFIX
    parent = os.path.dirname(os.path.abspath(final))
    if os.path.lexists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        fsync_directory(parent)
    os.replace(tmp, final)
    fsync_directory(parent)
    shutil.rmtree(old, ignore_errors=True)


def directory_beside(path: str, label: str = "tmp") -> str:
    """A new, empty, uniquely named directory next to `path` (same file system, so it renames into place), that
    no earlier run and no user file can already hold: `.NAME.tmp-XXXXXXXX`."""
    parent, name = os.path.split(os.path.abspath(path))
    while True:  # os.mkdir, not mkdtemp: the directory gets the user's usual permissions (umask), not 0700
        candidate = os.path.join(parent, f".{name}.{label}-{secrets.token_hex(4)}")
        try:
            os.mkdir(candidate)
            return candidate
        except FileExistsError:
            continue


def replace_output_directory(tmp: str, final: str) -> None:
    """A tool's output: rename the complete directory `tmp` to `final`. An existing `final` (which the caller has
    checked is its own earlier output) is renamed to a fresh name first and deleted after; no other path is ever
    deleted (unlike `final + ".old"`, which could be a user's directory)."""
    aside = None
    if os.path.lexists(final):
        aside = directory_beside(final, "old")
        os.replace(final, aside)  # a directory onto the new empty one
    os.replace(tmp, final)
    fsync_directory(os.path.dirname(os.path.abspath(final)))
    if aside:
        shutil.rmtree(aside, ignore_errors=True)
