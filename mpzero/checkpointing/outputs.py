"""Where a tool may write, so that nothing a user keeps is destroyed (issue 23, item 3).

A tool's output never is, contains or lies inside a checkpoint directory (a run's --save directory, or one
iteration of it) or the run directory the tool reads (--load), and an existing output is replaced only with
`--overwrite` and only when it is an earlier output of the same tool, recognized by its files. Anything else
is one ConfigError line naming the flag. Paths are compared resolved (os.path.realpath): a symbolic link or
`..` is no way around the check.
"""

from __future__ import annotations

import os
from typing import Callable

from mpzero.checkpointing.format import LATEST
from mpzero.checkpointing.reader import METADATA_FILE
from mpzero.errors import ConfigError

CONTAINS_DEPTH = 2  # how deep an output is searched for a checkpoint: a runs folder -> a run -> an iteration


def is_checkpoint_directory(path: str) -> bool:
    """A run's checkpoint directory (it has the latest pointer) or one saved iteration (DCP's .metadata, or an
    iter_* directory with meta.json)."""
    return (os.path.isfile(os.path.join(path, LATEST)) or os.path.isfile(os.path.join(path, METADATA_FILE))
            or (os.path.basename(path).startswith("iter_") and os.path.isfile(os.path.join(path, "meta.json"))))


def check_apart_from_checkpoints(path: str, flag: str, protected: dict[str, str | None] | None = None) -> None:
    """`path` neither is, contains nor lies inside a checkpoint directory or a directory of `protected`
    ({flag: directory}, e.g. {"--load": load}), else a ConfigError line."""
    real = os.path.realpath(path)
    for other_flag, other in (protected or {}).items():
        relation = _relation(real, os.path.realpath(other)) if other else None
        if relation:
            raise ConfigError(f"{flag} {path} {relation} {other_flag} {other}: choose a path outside it")
    at = real
    while True:
        if is_checkpoint_directory(at):
            relation = "is" if at == real else "lies inside"
            raise ConfigError(f"{flag} {path} {relation} the checkpoint directory {at}: choose a path outside it")
        parent = os.path.dirname(at)
        if parent == at:
            break
        at = parent
    inner = _checkpoint_within(real, CONTAINS_DEPTH)
    if inner:
        raise ConfigError(f"{flag} {path} contains the checkpoint directory {inner}: choose a path outside it")


def check_replaceable(path: str, flag: str, tool: str, overwrite: bool, foreign: Callable[[str], str | None]) -> None:
    """An existing `path` (other than an empty directory) is refused without `overwrite`; with it, `path` must be
    an earlier output of `tool`: `foreign(path)` says what is not (None: all of it is the tool's)."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path):
        return
    if not overwrite:
        raise ConfigError(f"{flag} {path} already exists: choose a new one, or pass --overwrite to replace an earlier "
                          f"output of {tool}")
    what = "a symbolic link" if os.path.islink(path) else foreign(path)
    if what:
        raise ConfigError(f"{flag} {path} is not an earlier output of {tool} ({what}): --overwrite replaces only "
                          f"those; choose a new one, or move it away yourself")


def foreign_files(directory: str, names: frozenset[str]) -> str | None:
    """What in `directory` a tool that writes only the regular files `names` did not write, or None."""
    if not os.path.isdir(directory):
        return "not a directory"
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.name not in names:
            return f"it holds {entry.name}"
        if not entry.is_file(follow_symlinks=False):
            return f"its {entry.name} is not a regular file"
    return None


def _relation(path: str, other: str) -> str | None:
    if path == other:
        return "is"
    if os.path.commonpath([path, other]) == other:
        return "lies inside"
    if os.path.commonpath([path, other]) == path:
        return "contains"
    return None


def _checkpoint_within(directory: str, depth: int) -> str | None:
    """A checkpoint directory strictly inside `directory`, at most `depth` levels down (links not followed)."""
    if depth == 0 or not os.path.isdir(directory) or os.path.islink(directory):
        return None
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError:
        return None
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            if is_checkpoint_directory(entry.path):
                return entry.path
            inner = _checkpoint_within(entry.path, depth - 1)
            if inner:
                return inner
    return None
