"""Index arrays built once by one rank, saved as .npy, loaded (memory-mapped) by every rank.

The file names carry an md5 of a description of everything the arrays depend on (for a GPT dataset: a
sha256 of its whole .idx file, which holds every sequence length and document boundary, and the split,
sequence length, seed and sample count), so neither a changed setting nor a dataset re-preprocessed into
the same prefix ever reads a stale cache.
The building rank writes each file under a temporary name and renames it; the description file comes
last and marks the set complete. It records, beside the description, each file's size and CRC-32: rank 0
checks both before using the cache and rebuilds a file set in which one is missing, truncated or damaged
(a cache written before these records is rebuilt once); the other ranks check the sizes after the barrier.
The other ranks wait at a barrier that also carries the builder's error, if any, so a failed build raises
on every rank instead of leaving them waiting.

`group` is None (one process), a `CommGroup`, or a `ParallelGroups` (its world group is used): the
group's rank 0 builds. Only `group.rank` and `group.all_gather_objects` are used.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from typing import Callable

import numpy as np

from mpzero.errors import ConfigError
from mpzero.files import atomic_open


MARKER_VERSION = 2  # the description file holds {"index_cache": 2, "description": ..., "files": {...}}


def load_or_build(cache_dir: str, kind: str, description: dict, build: Callable[[], dict[str, np.ndarray]],
                  names: tuple[str, ...], group=None) -> dict[str, np.ndarray]:
    """Arrays `names` for `description`, from `cache_dir` or made by `build()` on rank 0 and saved there."""
    text = json.dumps(description, sort_keys=True, indent=1)
    stem = os.path.join(cache_dir, f"{hashlib.md5(text.encode()).hexdigest()}-{kind}")
    paths = {name: f"{stem}-{name}.npy" for name in names}
    marker = f"{stem}-description.txt"
    group = getattr(group, "world", group)  # ParallelGroups -> its world CommGroup
    error, failure = None, None
    if group is None or group.rank == 0:
        damage = _check(marker, paths, full=True)
        if damage is not None:
            try:
                _save(cache_dir, build(), paths, marker, description)
                if damage[1]:  # not simply absent
                    print(f"note: index cache file {damage[0]} {damage[1]}: rebuilt it", flush=True)
            except ConfigError as exc:
                error, failure = str(exc), exc
            except Exception as exc:  # noqa: BLE001 - whatever it was, the other ranks must hear of it
                reason = f"index cache file {damage[0]} {damage[1]} and rebuilding it" if damage[1] else \
                    f"building the {kind} index cache in {cache_dir}"
                error, failure = (f"{reason} failed ({exc}): set --data-cache-path to a directory rank 0 can "
                                  f"write and all ranks can read"), exc
    if group is not None:
        # The barrier: nobody reads before rank 0 has finished, and rank 0's failure reaches everyone.
        error = group.all_gather_objects(error)[0]
    if failure is not None and not isinstance(failure, (OSError, ConfigError)):
        raise failure  # a bug, not bad input: keep its traceback
    if error:
        raise ConfigError(error)
    def verify():  # rank 0 has just verified or written the set; another node may not see it
        damage = _check(marker, paths, full=False)
        if damage is not None:
            raise ConfigError(f"index cache file {damage[0]} {damage[1] or 'is missing'} after rank 0 built it: "
                              f"--data-cache-path must be a directory every rank can read (a shared file system)")

    if group is None:
        verify()
    else:  # agreed: every rank stops with the line, not rank 0 later with a peer's broken connection
        error = group.run_agreed(verify, (ConfigError,))[1]
        if error:
            raise ConfigError(error)
    arrays = {}
    for name, path in paths.items():
        try:
            arrays[name] = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as exc:
            raise ConfigError(f"index cache file {path} is unreadable ({exc}): delete it to have it rebuilt") from None
    return arrays


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            crc = zlib.crc32(block, crc)
    return crc


def _check(marker: str, paths: dict[str, str], full: bool) -> tuple[str, str] | None:
    """None when the marker and every file it records are there with their recorded sizes (and, if `full`,
    CRC-32s); else (the first bad file, what is wrong with it: "" when the set was simply never completed)."""
    try:
        with open(marker, encoding="utf-8") as f:
            recorded = json.load(f)
    except FileNotFoundError:
        return marker, ""
    except (OSError, ValueError):
        return marker, "is damaged"
    files = recorded.get("files") if isinstance(recorded, dict) and recorded.get("index_cache") == MARKER_VERSION \
        else None
    if not isinstance(files, dict):
        return marker, "has no sizes and checksums (written by an older mpzero)"
    for name, path in paths.items():
        want = files.get(name)
        if not isinstance(want, dict):
            return marker, f"records no {name}"
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            return path, "is missing"
        if size != want.get("size"):
            return path, f"has {size} bytes, {want.get('size')} recorded"
        if full and _crc32(path) != want.get("crc32"):
            return path, "is damaged (CRC-32 mismatch)"
    return None


def _save(cache_dir: str, arrays: dict[str, np.ndarray], paths: dict[str, str], marker: str,
          description: dict) -> None:
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f".tmp{os.getpid()}"
    files = {}
    for name, path in paths.items():
        with atomic_open(path, tmp) as f:
            np.save(f, arrays[name])
        files[name] = {"size": os.path.getsize(path), "crc32": _crc32(path)}
    text = json.dumps({"index_cache": MARKER_VERSION, "description": description, "files": files}, sort_keys=True,
                      indent=1)
    with atomic_open(marker, tmp) as f:
        f.write(text.encode("utf-8"))
