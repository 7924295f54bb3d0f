"""Checking a whole checkpoint in one process (no process group): `tools/checkpoint_util.py verify`.

Every file is read: meta.json, DCP's .metadata, every stored chunk of every .distcp shard (against its recorded
checksum, format 3), every checksum and RNG file. The first problem is one ConfigError line naming the
checkpoint, the file (and, for a chunk, the key) and the previous iteration to load instead.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from typing import Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from mpzero.checkpointing.checksums import ALGORITHMS, read_checksums
from mpzero.checkpointing.format import published_dir
from mpzero.checkpointing.meta import (check_shard_files, latest_iteration, previous_advice, read_dcp_metadata,
                                       read_meta_file)
from mpzero.checkpointing.reader import CheckpointReader, error_reason
from mpzero.checkpointing.sharding import Chunk, ChunksLoadPlanner, LocalShare
from mpzero.errors import ConfigError

BATCH_BYTES = 256 << 20  # stored chunks read per dcp.load call: bounds the memory verify needs
NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """DCP warns on every load or save without a process group; in one process that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NO_DIST_WARNING)
        yield


def resolve_iteration(root: str, iteration: int | None) -> tuple[str, int]:
    """(directory, iteration) of checkpoint `iteration` (default: the latest) under `root`, or a ConfigError."""
    if not os.path.isdir(root):
        raise ConfigError(f"--load {root}: no such directory")
    iteration = latest_iteration(root) if iteration is None else iteration
    if iteration is None:
        raise ConfigError(f"no mpzero checkpoint under {root} (no latest_checkpointed_iteration.txt): "
                          f"pass the --save directory of a run")
    directory = published_dir(root, iteration)
    if not os.path.isdir(directory):
        raise ConfigError(f"no mpzero checkpoint under {root} at iteration {iteration} ({directory} is missing)")
    return directory, iteration


def verify_checkpoint(root: str, iteration: int | None = None) -> str:
    """One line saying what was checked; the first problem is a ConfigError."""
    directory, iteration = resolve_iteration(root, iteration)
    advice = previous_advice(root, iteration)
    meta = read_meta_file(directory, advice)
    metadata = read_dcp_metadata(directory, advice)
    check_shard_files(directory, metadata, advice)
    checksums = read_checksums(directory, meta["layout"]["world"], advice) if meta.get("checksums") else None
    rng_files = _check_rng_files(directory, meta["layout"].get("world"), advice)
    stored = []  # (file, key, offsets, sizes, dtype, stored size)
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        for index, chunk in enumerate(md.chunks):
            info = (metadata.storage_data or {}).get(MetadataIndex(key, chunk.offsets, index))
            name = getattr(info, "relative_path", None) or "?"
            stored.append((name, key, tuple(chunk.offsets), tuple(chunk.sizes), md.properties.dtype, md.size))
    stored.sort(key=lambda s: (s[0], s[1], s[2]))
    verified = 0
    for batch in _batches(stored):
        verified += _read_batch(directory, batch, checksums, advice)
    files = len({s[0] for s in stored})
    if checksums is None:
        what = f"read (no checksums: format {meta.get('format', 1)}, so a flipped bit in the data cannot be seen)"
    elif checksums[0] not in ALGORITHMS:
        what = f"read ({checksums[0]} checksums not verified: pip install {checksums[0]})"
    else:
        what = f"verified ({checksums[0]})"
    return (f"OK: checkpoint {directory}: {verified if checksums else len(stored)} chunks in {files} files {what}; "
            f"meta.json, .metadata and {rng_files} RNG files readable")


def _batches(stored: list) -> Iterator[list]:
    batch, size = [], 0
    for item in stored:
        nbytes = math.prod(item[3]) * item[4].itemsize
        if batch and size + nbytes > BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += nbytes
    if batch:
        yield batch


def _read_batch(directory: str, batch: list, checksums, advice: str) -> int:
    """Read the stored chunks of `batch` whole (each is verified against its checksum as it arrives); a chunk
    that cannot be read at all is found by reading the batch's chunks one at a time."""
    try:
        return _load(directory, batch, checksums, advice)
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 - find the chunk, then say what went wrong with it
        for item in batch:
            try:
                _load(directory, [item], checksums, advice)
            except ConfigError:
                raise
            except Exception as error:  # noqa: BLE001 - a damaged pickle or zip raises anything
                name, key, offsets = item[:3]
                raise ConfigError(f"checkpoint {directory}: {name} holds an unreadable chunk of {key} at "
                                  f"{list(offsets)} ({error_reason(error)}): {advice}") from None
        raise


def _load(directory: str, batch: list, checksums, advice: str) -> int:
    shares: dict[str, LocalShare] = {}
    for _, key, offsets, sizes, dtype, size in batch:
        share = shares.setdefault(key, LocalShare(tuple(size), []))
        share.chunks.append(Chunk(offsets, sizes, torch.empty(sizes, dtype=dtype)))
    planner = ChunksLoadPlanner(checksums, directory, advice)
    try:
        with single_process():
            dcp.load(shares, checkpoint_id=directory, storage_reader=CheckpointReader(directory), planner=planner,
                     no_dist=True)
    except dcp.CheckpointException as failure:  # unwrap: the caller tells a checksum mismatch from the rest
        errors = [f[0] if isinstance(f, tuple) else f for _, f in sorted(failure.failures.items())]
        raise (errors[0] if errors else failure) from None
    return planner.verified


def _check_rng_files(directory: str, world, advice: str) -> int:
    """Every rank's RNG file (where the checkpoint has any: from-consolidated ones have none) loads."""
    folder = os.path.join(directory, "rng")
    if not os.path.isdir(folder):
        return 0
    names = [f"rank_{rank:05d}.pt" for rank in range(world if isinstance(world, int) else 0)]
    for name in names:
        try:
            torch.load(os.path.join(folder, name), weights_only=True)
        except FileNotFoundError:
            raise ConfigError(f"checkpoint {directory}: rng/{name} is missing: {advice}") from None
        except Exception as error:  # noqa: BLE001 - a damaged pickle or zip raises anything
            raise ConfigError(f"checkpoint {directory}: rng/{name} is unreadable ({error_reason(error)}): "
                              f"{advice}") from None
    return len(names)
