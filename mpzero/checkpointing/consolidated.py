"""A checkpoint as one bundle of full fp32 weights, and back: `read_consolidated` gives every parameter whole by
name whatever layout saved it (every chunk checked against its checksum); `save_weights_only` writes such a
bundle as a weights-only checkpoint (iteration 0) loadable at any layout. tools/checkpoint_util.py,
tools/export_hf.py, tools/import_hf.py, tools/generate.py and bench/bench_generate.py go through these;
`load_whole` reads whole tensors by key from any DCP checkpoint (tools/import_megatron.py's too)."""

from __future__ import annotations

import json
import math
import os

import torch
import torch.distributed.checkpoint as dcp

from mpzero.checkpointing.checksums import ALGORITHM, read_checksums, write_rank_checksums
from mpzero.checkpointing.format import (FORMAT, LATEST, MASTER, checkpoint_dir, checkpoint_key,
                                         parse_checkpoint_key)
from mpzero.checkpointing.meta import check_shard_files, previous_advice, read_dcp_metadata, read_meta_file
from mpzero.checkpointing.reader import CheckpointReader, error_reason
from mpzero.checkpointing.sharding import Chunk, ChunksLoadPlanner, ChunksSavePlanner, LocalShare
from mpzero.checkpointing.verify import resolve_iteration
from mpzero.errors import ConfigError
from mpzero.files import fresh_directory, replace_directory, write_atomically
from mpzero.scale import machine_bytes


def _whole(tensors: dict[str, torch.Tensor]) -> dict[str, LocalShare]:
    """Whole tensors as mpzero's planners take them: one chunk each, at offset zero."""
    return {key: LocalShare(tuple(t.shape), [Chunk((0,) * t.dim(), tuple(t.shape), t)]) for key, t in tensors.items()}


def read_consolidated(load: str, iteration: int | None) -> dict:
    """{"model": {parameter name: full fp32 tensor}, "meta": meta.json} of a checkpoint at any layout, every
    chunk checked against its checksum (tools/export_hf.py and tools/generate.py read checkpoints through it)."""
    directory, iteration = resolve_iteration(load, iteration)
    advice = previous_advice(load, iteration)
    meta = read_meta_file(directory, advice)
    check_shard_files(directory, read_dcp_metadata(directory, advice), advice)
    checksums = read_checksums(directory, meta["layout"]["world"], advice) if meta.get("checksums") else None
    names = {}  # checkpoint key: parameter name, for the fp32 weights
    for key in meta["shapes"]:
        try:
            state, name = parse_checkpoint_key(key)
        except ValueError:
            raise ConfigError(f"checkpoint {directory}: meta.json is damaged (key {key!r}): {advice}") from None
        if state == MASTER:
            names[key] = name
    _check_fits(directory, [meta["shapes"][key] for key in names], advice)
    model = {key: torch.zeros(meta["shapes"][key]) for key in names}
    # every stored chunk is read whole into its place, so each is checked against its checksum
    load_whole(model, CheckpointReader(directory), ChunksLoadPlanner(checksums, directory, advice),
               f"{advice}; `verify` names the damaged file")
    return {"model": {names[key]: t for key, t in model.items()}, "meta": meta}


def load_whole(tensors: dict[str, torch.Tensor], reader: CheckpointReader, planner: ChunksLoadPlanner,
               advice: str) -> None:
    """Fill each tensor of `tensors` (by stored key, at its global shape) from the checkpoint `reader` reads, in
    one process; a shard that cannot be read is one ConfigError line naming the checkpoint and ending in `advice`."""
    directory = str(reader.path)
    try:
        dcp.load(_whole(tensors), checkpoint_id=directory, storage_reader=reader, planner=planner, no_dist=True)
    except dcp.CheckpointException as failure:
        error = next(iter(failure.failures.values()), (failure,))
        error = error[0] if isinstance(error, tuple) else error
        if isinstance(error, ConfigError):
            raise error from None
        raise ConfigError(f"checkpoint {directory}: reading its shards failed ({error_reason(error)}): "
                          f"{advice}") from None


def _check_fits(directory: str, shapes: list, advice: str) -> None:
    """The full fp32 weights meta.json describes fit in this machine's memory, checked before any is allocated:
    a damaged (or hostile) shape of 10**12 elements is one line, not an allocator's traceback."""
    need, have = 4 * sum(math.prod(shape) for shape in shapes), machine_bytes("cpu", None)["host memory"]
    if need > have:
        raise ConfigError(f"checkpoint {directory}: meta.json's shapes hold {need // 4:,} fp32 weights "
                          f"({need / 2 ** 30:,.1f} GiB), more than this machine's {have / 2 ** 30:,.1f} GiB of memory: "
                          f"its meta.json is damaged, or read it on a larger machine; {advice}")


def save_weights_only(bundle: dict, save: str) -> None:
    """A weights-only checkpoint (iteration 0) under `save` from {"model": {name: full tensor}, "meta": {"config":
    flags, "tokenizer": its record, if known}} (tools/import_hf.py writes through it)."""
    tensors = {checkpoint_key(MASTER, name): t.float() for name, t in bundle["model"].items()}
    directory = checkpoint_dir(save, 0)
    if os.path.exists(directory):
        raise ConfigError(f"--save {save} already holds {directory}: choose an empty directory")
    tmp = directory + ".tmp"
    fresh_directory(tmp)  # what a crash during an earlier conversion left, or a link planted there, goes first
    planner = ChunksSavePlanner(checksums=True)
    dcp.save(_whole(tensors), checkpoint_id=tmp, planner=planner, no_dist=True)
    write_rank_checksums(tmp, 0, planner.written_checksums())
    given = bundle.get("meta") if isinstance(bundle.get("meta"), dict) else {}
    meta = {"format": FORMAT, "iteration": 0, "consumed_samples": 0, "skipped_iterations": 0,
            "config": given.get("config", {}), "layout": {"world": 1, "tp": 1, "dp": 1},
            "shapes": {key: list(t.shape) for key, t in tensors.items()}, "checksums": ALGORITHM,
            **({"tokenizer": given["tokenizer"]} if given.get("tokenizer") else {})}
    write_atomically(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1, sort_keys=True))
    replace_directory(tmp, directory)
    write_atomically(os.path.join(save, LATEST), "0")
