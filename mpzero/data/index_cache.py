"""Index arrays built once by one rank, saved as .npy, loaded (memory-mapped) by every rank.

The file names carry an md5 of a description of everything the arrays depend on (for a GPT dataset: a
sha256 of its whole .idx file, which holds every sequence length and document boundary, and the split,
sequence length, seed and sample count), so neither a changed setting nor a dataset re-preprocessed into
the same prefix ever reads a stale cache.
The building rank writes each file under a temporary name and renames it; the description file comes
last and marks the set complete. The other ranks wait at a barrier that also carries the builder's
error, if any, so a failed build raises on every rank instead of leaving them waiting.

`group` is None (one process), a `CommGroup`, or a `ParallelGroups` (its world group is used): the
group's rank 0 builds. Only `group.rank` and `group.all_gather_objects` are used.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Callable

import numpy as np

from mpzero.errors import ConfigError
from mpzero.files import atomic_open


def load_or_build(cache_dir: str, kind: str, description: dict, build: Callable[[], dict[str, np.ndarray]],
                  names: tuple[str, ...], group=None) -> dict[str, np.ndarray]:
    """Arrays `names` for `description`, from `cache_dir` or made by `build()` on rank 0 and saved there."""
    text = json.dumps(description, sort_keys=True, indent=1)
    stem = os.path.join(cache_dir, f"{hashlib.md5(text.encode()).hexdigest()}-{kind}")
    paths = {name: f"{stem}-{name}.npy" for name in names}
    marker = f"{stem}-description.txt"
    group = getattr(group, "world", group)  # ParallelGroups -> its world CommGroup
    error, failure = None, None
    if (group is None or group.rank == 0) and not os.path.isfile(marker):
        try:
            _save(cache_dir, build(), paths, marker, text)
        except ConfigError as exc:
            error, failure = str(exc), exc
        except Exception as exc:  # noqa: BLE001 - whatever it was, the other ranks must hear of it
            error, failure = (f"building the {kind} index cache in {cache_dir} failed ({exc}): set "
                              f"--data-cache-path to a directory rank 0 can write and all ranks can read"), exc
    if group is not None:
        # The barrier: nobody reads before rank 0 has finished, and rank 0's failure reaches everyone.
        error = group.all_gather_objects(error)[0]
    if failure is not None and not isinstance(failure, (OSError, ConfigError)):
        raise failure  # a bug, not bad input: keep its traceback
    if error:
        raise ConfigError(error)
    missing = [p for p in [marker, *paths.values()] if not os.path.isfile(p)]
    if missing:
        raise ConfigError(f"index cache file {missing[0]} is missing after rank 0 built it: --data-cache-path "
                          f"must be a directory every rank can read (a shared file system)")
    return {name: np.load(path, mmap_mode="r") for name, path in paths.items()}


def _save(cache_dir: str, arrays: dict[str, np.ndarray], paths: dict[str, str], marker: str, text: str) -> None:
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f".tmp{os.getpid()}"
    for name, path in paths.items():
        with atomic_open(path, tmp) as f:
            np.save(f, arrays[name])
    with atomic_open(marker, tmp) as f:
        f.write(text.encode("utf-8"))
