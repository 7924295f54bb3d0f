"""Sharded checkpoints on `torch.distributed.checkpoint`, in Megatron's directory layout:

    SAVE/latest_checkpointed_iteration.txt      "100"
    SAVE/iter_0000100/.metadata, __*.distcp     model weights (fp32) and Adam moments, by name and global shape
    SAVE/iter_0000100/meta.json                 format, iteration, consumed samples, optimizer step, loss
                                                scaler, layout, global shapes, the resolved configuration
    SAVE/iter_0000100/rng/rank_00000.pt         each rank's generator states

Saving is atomic: every rank writes into `iter_0000100.tmp`, and only when all are done does rank 0
rename it and then rewrite the latest pointer (itself through a temporary file). A crash mid-save leaves
the previous checkpoint and pointer untouched; the stale temporary directory is removed by the next save.
Each rank writes and reads its own ZeRO partition of every tensor in place (sharding.py's DCP planners).
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from mpzero.checkpointing.format import (FORMAT, LATEST, MASTER, MOMENTS, OLD_SUFFIX, TMP_SUFFIX, checkpoint_dir,
                                         checkpoint_key, parse_checkpoint_key)
from mpzero.checkpointing.sharding import ChunksLoadPlanner, ChunksSavePlanner, LocalShare, chunks
from mpzero.errors import ConfigError, TrainingError
from mpzero.files import check_output_directory, replace_directory, write_atomically
from mpzero.parallel import ParallelGroups
from mpzero.tensor_parallel import RNGStatesTracker, TensorPlacement, placements


def save_checkpoint(root: str, iteration: int, model, optimizer, rng: RNGStatesTracker, groups: ParallelGroups,
                    meta: dict) -> str:
    """Collective: every rank calls it. Returns the published directory. A failed write on any rank (a full
    disk, a read-only file system) is a TrainingError on every rank, with the partial directory removed and
    the latest pointer still on the previous checkpoint."""
    tmp = write_unpublished(root, iteration, model, optimizer, rng, groups, meta)
    final = checkpoint_dir(root, iteration)
    if groups.world.rank == 0:
        replace_directory(tmp, final)
        write_atomically(os.path.join(root, LATEST), str(iteration))
        remove_stale_temporaries(root)
    dist.barrier()
    return final


def write_unpublished(root: str, iteration: int, model, optimizer, rng, groups: ParallelGroups, meta: dict) -> str:
    """Everything but the publication: the complete checkpoint under its temporary name."""
    tmp = checkpoint_dir(root, iteration) + TMP_SUFFIX
    where = placements(model.named_parameters())
    step = optimizer.adam_step()

    def make_directory():
        if groups.world.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
            os.makedirs(os.path.join(tmp, "rng"))

    def write_rank_files():
        snapshot = rng.snapshot()
        write_atomically(os.path.join(tmp, "rng", f"rank_{groups.world.rank:05d}.pt"),
                         lambda f: torch.save(snapshot, f))
        if groups.world.rank == 0:
            shapes = {checkpoint_key(k, name): list(p.global_shape(groups.tp_size))
                      for k in (MASTER,) + MOMENTS for name, p in where.items()}
            full = {**meta, "format": FORMAT, "iteration": iteration,
                    "optimizer": {"step": step, "loss_scaler": optimizer.scaler.state_dict(),
                                  "iteration": optimizer.iteration},
                    "layout": {"world": groups.world.size, "tp": groups.tp_size, "dp": groups.dp_size},
                    "shapes": shapes}
            write_atomically(os.path.join(tmp, "meta.json"), json.dumps(full, indent=1, sort_keys=True))

    _agreed(make_directory, tmp, root, groups)
    try:  # DCP gathers every rank's write result: a failure anywhere raises on every rank
        dcp.save(_local_shares(optimizer, where, (MASTER,) + MOMENTS, groups, writing=True), checkpoint_id=tmp,
                 planner=ChunksSavePlanner())
    except (OSError, dcp.CheckpointException) as error:  # DCP's exception carries every failed rank's error
        _fail_save(tmp, root, groups, _first_os_error(error))
    _agreed(write_rank_files, tmp, root, groups)
    return tmp


def _agreed(step, tmp: str, root: str, groups: ParallelGroups) -> None:
    """Run this rank's part of a save, then agree over the world whether every rank's part succeeded (the
    exchange is the barrier), so a rank whose disk failed does not leave the others waiting."""
    error = None
    try:
        step()
    except OSError as failure:
        error = f"rank {groups.world.rank}: {failure.strerror or failure}"
    errors = [e for e in groups.world.all_gather_objects(error) if e]
    if errors:
        _fail_save(tmp, root, groups, errors[0])


def _first_os_error(error: BaseException) -> BaseException:
    """The OSError behind a CheckpointException (it maps each failed rank to its exception), else `error`.
    A write that ran out of space can also surface as the zip writer's RuntimeError: say what the disk says."""
    failures = error.failures if isinstance(error, dcp.CheckpointException) else {}
    # each value is (exception, traceback summary)
    errors = [failure[0] if isinstance(failure, tuple) else failure for failure in failures.values()]
    return next((e for e in errors if isinstance(e, OSError)), errors[0] if errors else error)


def _fail_save(tmp: str, root: str, groups: ParallelGroups, error) -> None:
    if groups.world.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    latest = latest_iteration(root)
    kept = f"the latest checkpoint (iteration {latest}) is intact" if latest is not None else "no checkpoint was kept"
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error).strip()
    reason = reason.splitlines()[-1][:300] if reason else type(error).__name__
    raise TrainingError(f"saving a checkpoint to {tmp} failed ({reason}); {kept}: free space on "
                        f"--save {root} or point it elsewhere")


def remove_stale_temporaries(root: str) -> None:
    """After a successful save: partial directories left by killed saves of any iteration (`iter_*.tmp`) and
    replaced ones (`iter_*.old`) are garbage; nothing reads them."""
    for name in os.listdir(root):
        if name.startswith("iter_") and name.endswith((TMP_SUFFIX, OLD_SUFFIX)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def check_save_directory(save: str, load: str | None, finetune: bool, overwrite: bool) -> None:
    """At start: `save` must be writable, and a run that does not continue from `save`'s own latest checkpoint
    must not silently save over it (it would move the latest pointer back to its own iterations)."""
    check_output_directory(save, "--save")
    latest = latest_iteration(save)
    continues = load is not None and os.path.realpath(load) == os.path.realpath(save) and not finetune
    if latest is not None and not continues and not overwrite:
        raise ConfigError(f"--save {save} already holds checkpoints up to iteration {latest}, and this run does "
                          f"not continue from them: pass --load {save} to continue, choose another --save, or "
                          f"--overwrite-checkpoints to save this run over them")


def latest_iteration(root: str) -> int | None:
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ConfigError(f"{path} holds {text[:40]!r}, not an iteration number: fix or delete it")
    return int(text)


def read_meta(root: str) -> tuple[str, dict] | None:
    """(directory, meta.json contents) of the latest checkpoint under `root`, or None when there is none; reads
    no tensors, so a run can size its data from the checkpoint's consumed samples before building anything."""
    iteration = latest_iteration(root)
    if iteration is None:
        return None
    directory = checkpoint_dir(root, iteration)
    meta_path = os.path.join(directory, "meta.json")
    if not os.path.isfile(meta_path):
        raise ConfigError(f"{directory} has no meta.json: not an mpzero checkpoint, or damaged")
    with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("format", 1) > FORMAT:  # format 1 (no field) and 2 store the same keys
        raise ConfigError(f"{directory} is in checkpoint format {meta['format']}, newer than this mpzero's "
                          f"({FORMAT}): load it with the mpzero that wrote it")
    return directory, meta


def load_checkpoint(root: str, model, optimizer, rng: RNGStatesTracker, groups: ParallelGroups,
                    load_optim: bool = True, load_rng: bool = True, architecture: dict | None = None) -> dict | None:
    """Collective. Loads the latest checkpoint under `root` into the model, optimizer and RNG; returns its
    meta (iteration, consumed samples, ...) or None when `root` holds no checkpoint yet. `architecture`: the
    settings that give the weights their meaning ({flag name: value}, saved under meta["architecture"]); the
    first one that differs from the checkpoint's is a ConfigError, even where the shapes would agree."""
    found = read_meta(root)
    if found is None:
        return None
    directory, meta = found
    if architecture:
        _check_same_architecture(meta, architecture, directory)
    where = placements(model.named_parameters())
    _check_same_model(meta, where, groups.tp_size, directory)
    if load_optim and "optimizer" not in meta:
        raise ConfigError(f"{directory} holds model weights only: load it with --finetune or --no-load-optim")
    keys = (MASTER,) + MOMENTS if load_optim else (MASTER,)
    dcp.load(_local_shares(optimizer, where, keys, groups, writing=False), checkpoint_id=directory,
             planner=ChunksLoadPlanner())
    if load_optim:
        optimizer.load_owned_pieces(**meta["optimizer"])
    else:
        optimizer.load_owned_pieces()
    if load_rng:
        _load_rng(directory, meta, rng, groups)
    return meta


def _load_rng(directory: str, meta: dict, rng: RNGStatesTracker, groups: ParallelGroups) -> None:
    """Per-rank dropout streams only mean something at the layout that drew them."""
    path = os.path.join(directory, "rng", f"rank_{groups.world.rank:05d}.pt")
    same_layout = (meta["layout"]["world"], meta["layout"]["tp"]) == (groups.world.size, groups.tp_size)
    if not (same_layout and os.path.isfile(path)):
        if groups.is_logging_rank:
            print(f"note: checkpoint layout {meta['layout']} has no RNG states for this run's: not loaded")
        return
    rng.restore(torch.load(path, weights_only=True))


def _check_same_architecture(meta: dict, architecture: dict, directory: str) -> None:
    """Megatron's check_checkpoint_args: e.g. 4 heads saved, 8 loaded, gives QKV rows of the same shape that
    mean something else. Checkpoints that predate meta["architecture"] are compared on their saved flags."""
    saved = meta.get("architecture") or meta.get("config") or {}
    for name, value in architecture.items():
        if name in saved and saved[name] != value:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{directory} was saved with {flag} {saved[name]}, this run has {value}: the "
                              f"weights would mean something else; match the model flags or point --load elsewhere")


def _check_same_model(meta: dict, where: dict[str, TensorPlacement], tp_size: int, directory: str) -> None:
    saved = {}
    for key, shape in meta["shapes"].items():
        state, name = parse_checkpoint_key(key)
        if state == MASTER:
            saved[name] = tuple(shape)
    here = {name: p.global_shape(tp_size) for name, p in where.items()}
    for name in sorted(set(saved) | set(here)):
        if saved.get(name) != here.get(name):
            raise ConfigError(f"{directory} is from another model: {name} is {saved.get(name, 'absent')} there and "
                              f"{here.get(name, 'absent')} here; match the model flags or point --load elsewhere")


def _local_shares(optimizer, where: dict[str, TensorPlacement], keys: tuple[str, ...], groups: ParallelGroups,
                  writing: bool) -> dict[str, LocalShare]:
    """{checkpoint key: this rank's chunks (views into the optimizer's state) of that global tensor} for `keys`
    among master / exp_avg / exp_avg_sq. TP-replicated parameters are written by TP rank 0 alone."""
    per_key: dict[str, LocalShare] = {}
    for piece in optimizer.owned_pieces():
        placement = where[piece.name]
        if writing and placement.partition_dim is None and groups.tp_rank != 0:
            continue
        for k in keys:
            share = per_key.setdefault(checkpoint_key(k, piece.name),
                                       LocalShare(placement.global_shape(groups.tp_size), []))
            share.chunks.extend(chunks(piece, k, placement, groups.tp_rank))
    return {key: share for key, share in per_key.items() if share.chunks}
