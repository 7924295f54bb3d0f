"""Sharded checkpoints on `torch.distributed.checkpoint`, in Megatron's directory layout:

    SAVE/latest_checkpointed_iteration.txt      "100"
    SAVE/iter_0000100/.metadata, __*.distcp     model weights (fp32) and Adam moments, by name and global shape
    SAVE/iter_0000100/meta.json                 iteration, consumed samples, optimizer step, loss scaler,
                                                layout, global shapes, the resolved configuration
    SAVE/iter_0000100/rng/rank_00000.pt         each rank's generator states

Saving is atomic: every rank writes into `iter_0000100.tmp`, and only when all are done does rank 0
rename it and then rewrite the latest pointer (itself through a temporary file). A crash mid-save leaves
the previous checkpoint and pointer untouched; the stale temporary directory is removed by the next save.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from mpzero.checkpointing.sharding import chunks, sharded
from mpzero.errors import ConfigError
from mpzero.parallel import ParallelGroups
from mpzero.tensor_parallel import RNGStatesTracker, TensorPlacement, placements

LATEST = "latest_checkpointed_iteration.txt"
MOMENTS = ("exp_avg", "exp_avg_sq")


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def save_checkpoint(root: str, iteration: int, model, optimizer, rng: RNGStatesTracker, groups: ParallelGroups,
                    meta: dict) -> str:
    """Collective: every rank calls it. Returns the published directory."""
    tmp = write_unpublished(root, iteration, model, optimizer, rng, groups, meta)
    final = checkpoint_dir(root, iteration)
    if groups.world.rank == 0:
        _replace_directory(tmp, final)
        _write_atomically(os.path.join(root, LATEST), str(iteration))
    dist.barrier()
    return final


def write_unpublished(root: str, iteration: int, model, optimizer, rng, groups: ParallelGroups, meta: dict) -> str:
    """Everything but the publication: the complete checkpoint under its temporary name."""
    tmp = checkpoint_dir(root, iteration) + ".tmp"
    if groups.world.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
        os.makedirs(os.path.join(tmp, "rng"))
    dist.barrier()
    where = placements(model.named_parameters())
    step = optimizer.adam_step()  # collective: before rank 0 goes its own way
    dcp.save(_state_views(optimizer, where, ("master",) + MOMENTS, groups, writing=True), checkpoint_id=tmp)
    torch.save(rng.snapshot(), os.path.join(tmp, "rng", f"rank_{groups.world.rank:05d}.pt"))
    if groups.world.rank == 0:
        keys = [_key(k, name) for k in ("master",) + MOMENTS for name in where]
        meta = {**meta, "iteration": iteration, "optimizer": {"step": step, "loss_scaler": optimizer.scaler.state_dict(),
                                                              "iteration": optimizer.iteration},
                "layout": {"world": groups.world.size, "tp": groups.tp_size, "dp": groups.dp_size},
                "shapes": {key: list(where[_param_name(key)].global_shape(groups.tp_size)) for key in keys}}
        _write_atomically(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1, sort_keys=True))
    dist.barrier()
    return tmp


def latest_iteration(root: str) -> int | None:
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ConfigError(f"{path} holds {text[:40]!r}, not an iteration number: fix or delete it")
    return int(text)


def load_checkpoint(root: str, model, optimizer, rng: RNGStatesTracker, groups: ParallelGroups,
                    load_optim: bool = True, load_rng: bool = True) -> dict | None:
    """Collective. Loads the latest checkpoint under `root` into the model, optimizer and RNG; returns its
    meta (iteration, consumed samples, ...) or None when `root` holds no checkpoint yet."""
    iteration = latest_iteration(root)
    if iteration is None:
        return None
    directory = checkpoint_dir(root, iteration)
    meta_path = os.path.join(directory, "meta.json")
    if not os.path.isfile(meta_path):
        raise ConfigError(f"{directory} has no meta.json: not an mpzero checkpoint, or damaged")
    with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    where = placements(model.named_parameters())
    _check_same_model(meta, where, groups.tp_size, directory)
    if load_optim and "optimizer" not in meta:
        raise ConfigError(f"{directory} holds model weights only: load it with --finetune or --no-load-optim")
    keys = ("master",) + MOMENTS if load_optim else ("master",)
    dcp.load(_state_views(optimizer, where, keys, groups, writing=False), checkpoint_id=directory)
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


def _check_same_model(meta: dict, where: dict[str, TensorPlacement], tp_size: int, directory: str) -> None:
    saved = {key[len("model/"):]: tuple(shape) for key, shape in meta["shapes"].items() if key.startswith("model/")}
    here = {name: p.global_shape(tp_size) for name, p in where.items()}
    for name in sorted(set(saved) | set(here)):
        if saved.get(name) != here.get(name):
            raise ConfigError(f"{directory} is from another model: {name} is {saved.get(name, 'absent')} there and "
                              f"{here.get(name, 'absent')} here; match the model flags or point --load elsewhere")


def _state_views(optimizer, where: dict[str, TensorPlacement], keys: tuple[str, ...], groups: ParallelGroups,
                 writing: bool) -> dict:
    """{checkpoint key: ShardedTensor over this rank's own pieces of the optimizer state} for `keys` among
    master / exp_avg / exp_avg_sq. TP-replicated parameters are written by TP rank 0 alone."""
    per_key = {}
    for piece in optimizer.owned_pieces():
        placement = where[piece.name]
        if writing and placement.partition_dim is None and groups.tp_rank != 0:
            continue
        for k in keys:
            per_key.setdefault(_key(k, piece.name), []).extend(chunks(piece, k, placement, groups.tp_rank))
    return {key: sharded(local, where[_param_name(key)].global_shape(groups.tp_size), groups)
            for key, local in per_key.items() if local}


def _key(state: str, name: str) -> str:
    """Checkpoint keys: model/<name> for the fp32 weights, optimizer/<moment>/<name> for Adam's moments."""
    return f"model/{name}" if state == "master" else f"optimizer/{state}/{name}"


def _param_name(key: str) -> str:
    return key.split("/", 1)[1] if key.startswith("model/") else key.split("/", 2)[2]


def _replace_directory(tmp: str, final: str) -> None:
    """Rename `tmp` to `final`. An existing `final` (the same iteration saved again) is renamed aside
    first and deleted only after: a crash leaves at most a moment in which neither name exists,
    instead of the whole deletion."""
    old = final + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def _write_atomically(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
