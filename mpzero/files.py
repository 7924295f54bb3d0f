"""The one writer of files: every file mpzero and its tools write goes through here (tests/test_files.py fails on
a bare open(..., "w") anywhere else). A file is complete or absent: it is written under a temporary name beside
the target, flushed and fsynced, renamed over the target (atomic on POSIX), and the directory fsynced so the
rename itself is durable. A crash at any moment leaves the old file (or none) and at most a `*.tmp*.RANDOM` file,
never a half-written target.

No write follows a link someone planted: a temporary file gets a name nobody can predict (64 random bits) and
is created exclusively (O_CREAT|O_EXCL|O_NOFOLLOW), the target is renamed over (a link there is replaced, not
followed), directories are made with os.mkdir (which fails on a name already taken), and a library that writes by
fixed names of its own (torch.profiler) writes into a private directory made here, the file then moved into
place (tests/test_planted_links.py plants a link at every name each entry point's writes can use).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import tempfile
from typing import BinaryIO, Callable, Iterator

from mpzero.errors import ConfigError

_NOFOLLOW, _CLOEXEC = getattr(os, "O_NOFOLLOW", 0), getattr(os, "O_CLOEXEC", 0)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
_ATTEMPTS = 100  # fresh names drawn before giving up: 64 random bits each, so only a planted name is ever taken


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
    """Rename the complete, closed file `tmp` (made by `create_beside`) to `path`, its bytes and the rename made
    durable. A link planted at `path` is replaced, never followed."""
    fd = os.open(tmp, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_directory(os.path.dirname(os.path.abspath(path)))


def temporary_name(path: str, label: str = ".tmp") -> str:
    """A name in `path`'s directory that nobody can predict: `NAME{label}` and `random_suffix()`."""
    return f"{os.path.abspath(path)}{label}{random_suffix()}"


def random_suffix() -> str:
    """`.` and 16 random hex digits (64 bits): what makes a name nobody can guess in advance."""
    return "." + _token()


def _token() -> str:
    return secrets.token_hex(8)


def remove_temporaries(path: str, label: str = ".tmp") -> None:
    """Delete the temporary files `create_beside(path, label)` made for `path` that a killed writer left (call it
    only where no other writer of `path` can be running). Links are removed, never followed."""
    parent, name = os.path.split(os.path.abspath(path))
    stem = name + label + "."
    for entry in os.listdir(parent):
        random = entry[len(stem):]
        if entry.startswith(stem) and len(random) == 16 and all(c in "0123456789abcdef" for c in random):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(parent, entry))


def create_beside(path: str, label: str = ".tmp") -> tuple[int, str]:
    """(fd open for writing, its name): a new empty file in `path`'s directory under `temporary_name`, created
    exclusively (O_CREAT|O_EXCL|O_NOFOLLOW: a link or file already at the name, planted or not, is never opened;
    another name is drawn) with the permissions the user's umask gives a new file."""
    for _ in range(_ATTEMPTS):
        name = temporary_name(path, label)
        try:
            return os.open(name, _CREATE, 0o666), name
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"{_ATTEMPTS} fresh temporary names in a row were taken", path)


def open_beside(path: str, label: str = ".tmp") -> tuple[BinaryIO, str]:
    """(binary file open for writing, its name): `create_beside`'s new file, for a writer that publishes it
    itself (`publish_file`) once complete."""
    fd, name = create_beside(path, label)
    return open(fd, "wb"), name


@contextlib.contextmanager
def atomic_open(path: str, suffix: str = ".tmp") -> Iterator[BinaryIO]:
    """`with atomic_open(path) as f: f.write(...)`: `path` appears complete when the block ends without an
    exception; on one, the temporary file is removed and `path` is untouched. The temporary file is
    `create_beside(path, suffix)`'s; `path` itself is renamed over (a link planted there is replaced, never
    followed)."""
    file, tmp = open_beside(path, suffix)
    try:
        with file as f:
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


def copy_atomically(source: str, path: str) -> None:
    """The bytes of the file `source` as `path`, written atomically (`write_atomically`)."""
    with open(source, "rb") as src:
        write_atomically(path, lambda f: shutil.copyfileobj(src, f, 1 << 24))


def fresh_directory(path: str) -> None:
    """`path` as a new, empty directory this process made: a directory left there (a killed earlier run's) is
    deleted, a link or file planted there is removed, never followed, and os.mkdir then fails rather than reuse
    anything that appeared at the name meanwhile. Missing parents are made."""
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    os.mkdir(path)


def private_directory(parent: str, label: str) -> str:
    """A new directory inside `parent` that only this user can enter (0700) under a fresh unpredictable name, for
    a library that writes files by fixed names of its own (torch.profiler's trace): nothing can be planted there."""
    for _ in range(_ATTEMPTS):
        name = temporary_name(os.path.join(parent, "." + label), "")
        try:
            os.mkdir(name, 0o700)
            return name
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"{_ATTEMPTS} fresh directory names in a row were taken", parent)


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
    no earlier run and no user file can already hold: `.NAME.tmp-` and 16 random hex digits."""
    parent, name = os.path.split(os.path.abspath(path))
    while True:  # os.mkdir, not mkdtemp: the directory gets the user's usual permissions (umask), not 0700
        candidate = os.path.join(parent, f".{name}.{label}-{_token()}")
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
