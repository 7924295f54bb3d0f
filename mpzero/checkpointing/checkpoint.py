"""Sharded checkpoints on `torch.distributed.checkpoint`, in Megatron's directory layout:

    SAVE/latest_checkpointed_iteration.txt      "100"
    SAVE/iter_0000100/.metadata, __*.distcp     model weights (fp32) and the update rule's states, by name and shape
    SAVE/iter_0000100/meta.json                 format, iteration, consumed samples, optimizer step, loss
                                                scaler, layout, global shapes, the resolved configuration
    SAVE/iter_0000100/rng/rank_00000.pt         each rank's generator states
    SAVE/iter_0000100/checksums/rank_00000.json a checksum of every chunk each rank wrote (format 3)

The save protocol (each step's file is complete before the next step begins; tests/test_checkpoint_protocol.py
stops a save at every step, and real kills stop it at random ones):
  1. rank 0 removes a stale `iter_N.tmp` (a link there is removed, never followed) and creates it with os.mkdir
     (with rng/ and checksums/);
  2. every rank writes its .distcp shards into it, each fsynced (DCP), then rank 0 DCP's .metadata (through
     `.metadata.tmp`, fsynced, renamed);
  3. every rank writes its RNG and checksum files, rank 0 meta.json, each atomically (files.write_atomically:
     a temporary file, fsync, rename, fsync of the directory), after the shards: meta.json is the last file;
  4. rank 0 publishes the directory: files.replace_directory renames `iter_N.tmp` to `iter_N` and fsyncs SAVE (an
     existing `iter_N`, the same iteration saved again, is first renamed to `iter_N.old`, fsynced, and deleted
     after);
  5. rank 0 rewrites the latest pointer atomically: the checkpoint is published;
  6. rank 0 removes what killed saves left (`iter_*.tmp`; an `iter_*.old` beside its `iter_*`), and renames back
     an `iter_N.old` without `iter_N` (a replacement killed between its renames: the only copy of N).
The invariant, at every moment: the latest pointer names a complete checkpoint (`iter_N`, or while `iter_N` is
between step 4's renames `iter_N.old`: format.published_dir), the last one published; every `iter_N` is complete
(it exists only by step 4's rename); anything half-written lies under a `.tmp` name and is gone after the next
save. Every file is fsynced before its rename and every rename is followed by an fsync of its directory (DCP's
.metadata rename by step 3's fsync of `iter_N.tmp`), so when step 5 publishes, all it names is on disk: a power
cut loses nothing the pointer names either.
Each rank writes and reads its own ZeRO partition of every tensor in place (sharding.py's DCP planners).

Loading verifies what it reads (meta.py checks the small files, checksums.py the chunks): each rank checks the
checksum of every stored chunk it reads (in full, also at another layout); `tools/checkpoint_util.py verify` checks
every chunk. A missing or damaged file (meta.json, .metadata, a .distcp shard, a checksum or RNG file) is one
ConfigError line naming the checkpoint, the file, and the previous iteration to load instead. Every rank checks the
files before the collective read and the ranks agree on the first error, so a failure only one rank sees stops them
all.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from mpzero.checkpointing.checksums import ALGORITHM, ALGORITHMS, DIRECTORY, read_checksums, write_rank_checksums
from mpzero.checkpointing.format import (FORMAT, LATEST, MASTER, OLD_SUFFIX, RULE_BEFORE_NAMED, TMP_SUFFIX,
                                         checkpoint_dir, checkpoint_key, parse_checkpoint_key, published_dir)
from mpzero.checkpointing.meta import (check_shard_files, latest_iteration, previous_advice, read_dcp_metadata,
                                       read_meta_file)
from mpzero.checkpointing.meta import META_KEYS, RESUME_KEYS, read_meta  # noqa: F401  (re-exported: tools, tests)
from mpzero.checkpointing.reader import CheckpointReader, error_reason
from mpzero.checkpointing.sharding import ChunksLoadPlanner, ChunksSavePlanner, LocalShare, chunks
from mpzero.errors import ConfigError, TrainingError
from mpzero.files import (check_output_directory, fresh_directory, fsync_directory, remove_temporaries,
                          replace_directory, write_atomically)
from mpzero.parallel import ParallelGroups
from mpzero.tensor_parallel import RNGStatesTracker, TensorPlacement, is_pipeline_copy, placements


def save_checkpoint(root: str, iteration: int, model, optimizer, rng: RNGStatesTracker, groups: ParallelGroups,
                    meta: dict, checksums: bool = True) -> str:
    """Collective: every rank calls it. Returns the published directory. A failed write on any rank (a full
    disk, a read-only file system) is a TrainingError on every rank, with the partial directory removed and
    the latest pointer still on the previous checkpoint. `checksums=False` (benchmarks) records none."""
    tmp = write_unpublished(root, iteration, model, optimizer, rng, groups, meta, checksums)
    final = checkpoint_dir(root, iteration)
    if groups.world.rank == 0:
        replace_directory(tmp, final)
        write_atomically(os.path.join(root, LATEST), str(iteration))
        remove_stale_temporaries(root)
    dist.barrier()
    return final


def pipeline_copies(model) -> frozenset[str]:
    """Names of the parameters this pipeline stage holds as copies of another stage's (the tied embedding)."""
    return frozenset(name for name, param in model.named_parameters() if is_pipeline_copy(param))


def write_unpublished(root: str, iteration: int, model, optimizer, rng, groups: ParallelGroups, meta: dict,
                      checksums: bool = True) -> str:
    """Everything but the publication: the complete checkpoint under its temporary name."""
    tmp = checkpoint_dir(root, iteration) + TMP_SUFFIX
    # Offload files deleted or cut short by someone else: nothing is written, the latest pointer stays
    _, error = groups.world.run_agreed(optimizer.check_files, (TrainingError,))
    if error:
        raise TrainingError(error)
    where = placements(model.named_parameters())
    copies = pipeline_copies(model)
    optimizer_meta = optimizer.meta_state()
    states = (MASTER,) + optimizer.rule.state_names
    shapes = {}  # every pipeline stage's parameters (rank 0 writes them into the meta)
    for stage in groups.pp.all_gather_objects({n: list(shape) for n, shape in global_shapes(where, groups).items()}):
        shapes.update(stage)

    def make_directory():
        if groups.world.rank == 0:
            fresh_directory(tmp)  # what a crash during an earlier save left, or a link planted there, goes first
            os.makedirs(os.path.join(tmp, "rng"))
            os.makedirs(os.path.join(tmp, DIRECTORY))

    planner = ChunksSavePlanner(checksums=checksums)

    def write_rank_files():
        snapshot = rng.snapshot()
        write_atomically(os.path.join(tmp, "rng", f"rank_{groups.world.rank:05d}.pt"),
                         lambda f: torch.save(snapshot, f))
        if checksums:
            write_rank_checksums(tmp, groups.world.rank, planner.written_checksums())
        if groups.world.rank == 0:
            full = {**meta, "format": FORMAT, "iteration": iteration,
                    "optimizer": optimizer_meta,
                    "layout": {"world": groups.world.size, "tp": groups.tp_size, "dp": groups.dp_size,
                               "pp": groups.pp_size, "ep": groups.ep.size, "etp": groups.expert_tp.size},
                    "shapes": {checkpoint_key(k, name): shape for k in states for name, shape in shapes.items()},
                    "checksums": ALGORITHM if checksums else None}
            write_atomically(os.path.join(tmp, "meta.json"), json.dumps(full, indent=1, sort_keys=True))

    _agreed(make_directory, tmp, root, groups)
    try:  # DCP gathers every rank's write result: a failure anywhere raises on every rank
        dcp.save(_local_shares(optimizer, where, states, groups, writing=True, skip=copies), checkpoint_id=tmp,
                 planner=planner)
    except (OSError, dcp.CheckpointException) as error:  # DCP's exception carries every failed rank's error
        _fail_save(tmp, root, groups, _first_os_error(error))
    _agreed(write_rank_files, tmp, root, groups)
    return tmp


def _agreed(step, tmp: str, root: str, groups: ParallelGroups) -> None:
    """Run this rank's part of a save; a rank whose disk failed fails the save on every rank."""
    _, error = groups.world.run_agreed(step, (OSError,),
                                       lambda failure: f"rank {groups.world.rank}: {error_reason(failure)}")
    if error:
        _fail_save(tmp, root, groups, error)


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
    reason = error if isinstance(error, str) else error_reason(error)
    raise TrainingError(f"saving a checkpoint to {tmp} failed ({reason}); {kept}: free space on "
                        f"--save {root} or point it elsewhere")


def remove_stale_temporaries(root: str) -> None:
    """After a successful save: partial directories left by killed saves of any iteration (`iter_*.tmp`) and
    replaced ones (`iter_*.old` beside their `iter_*`) are garbage; nothing reads them. An `iter_N.old` without
    `iter_N` is the only copy of checkpoint N (its replacement was killed between renames): renamed back. A latest
    pointer's temporary file left by a kill is removed too."""
    remove_temporaries(os.path.join(root, LATEST))
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not name.startswith("iter_"):
            continue
        if name.endswith(OLD_SUFFIX) and not os.path.lexists(path[:-len(OLD_SUFFIX)]):
            os.replace(path, path[:-len(OLD_SUFFIX)])
            fsync_directory(root)
        elif name.endswith((TMP_SUFFIX, OLD_SUFFIX)):
            shutil.rmtree(path, ignore_errors=True)


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


def load_checkpoint(root: str, model, optimizer, rng: RNGStatesTracker, groups: ParallelGroups,
                    load_optim: bool = True, load_rng: bool = True, architecture: dict | None = None) -> dict | None:
    """Collective. Loads the latest checkpoint under `root` into the model, optimizer and RNG; returns its
    meta (iteration, consumed samples, ...) or None when `root` holds no checkpoint yet. `architecture`: the
    settings that give the weights their meaning ({flag name: value}, saved under meta["architecture"]); the
    first one that differs from the checkpoint's is a ConfigError, even where the shapes would agree.
    A missing or damaged file is one ConfigError line on every rank (the ranks agree before reading)."""
    iteration = latest_iteration(root)
    if iteration is None:
        return None
    directory = published_dir(root, iteration)
    advice = previous_advice(root, iteration)
    where = placements(model.named_parameters())
    everywhere = set().union(*groups.pp.all_gather_objects(sorted(where)))  # every pipeline stage's names
    prepared, error = groups.world.run_agreed(
        lambda: _prepare_load(directory, advice, where, everywhere, groups, load_optim, load_rng, architecture,
                              optimizer.rule.name), (ConfigError,))
    if error:
        raise ConfigError(error)
    meta, checksums, rng_state, notes = prepared
    if groups.is_logging_rank:
        for note in notes:
            print(note, flush=True)
    keys = (MASTER,) + optimizer.rule.state_names if load_optim else (MASTER,)
    planner = ChunksLoadPlanner(checksums, directory, advice)
    try:  # DCP gathers every rank's read result: a failure anywhere raises on every rank
        dcp.load(_local_shares(optimizer, where, keys, groups, writing=False), checkpoint_id=directory,
                 storage_reader=CheckpointReader(directory), planner=planner)
    except dcp.CheckpointException as failure:
        raise ConfigError(_load_failure(failure, directory, advice, os.path.dirname(directory), iteration)) from None
    if load_optim:
        optimizer.load_owned_pieces(**{k: v for k, v in meta["optimizer"].items() if k != "rule"})
    else:
        optimizer.load_owned_pieces()
    if rng_state is not None:
        rng.restore(rng_state)
    return meta


def _prepare_load(directory: str, advice: str, where: dict[str, TensorPlacement], everywhere: set[str],
                  groups: ParallelGroups, load_optim: bool, load_rng: bool, architecture: dict | None, rule: str):
    """Everything a load checks and reads before the collective read of the shards: (meta, checksums, this
    rank's RNG states or None, notes to print). `everywhere`: the parameter names of every pipeline stage."""
    meta = read_meta_file(directory, advice)
    if architecture:
        _check_same_architecture(meta, architecture, directory)
    _check_same_model(meta, global_shapes(where, groups), everywhere, directory)
    if load_optim and "optimizer" not in meta:
        raise ConfigError(f"{directory} holds model weights only: load it with --finetune or --no-load-optim")
    saved_rule = meta.get("optimizer", {}).get("rule", RULE_BEFORE_NAMED) if load_optim else rule
    if saved_rule != rule:
        raise ConfigError(f"{directory} holds --optimizer {saved_rule} state, this run is --optimizer {rule}: "
                          f"train on with --optimizer {saved_rule}, or load the weights alone with --no-load-optim")
    check_shard_files(directory, read_dcp_metadata(directory, advice), advice)
    notes, checksums = [], None
    algorithm = meta.get("checksums")
    if algorithm:
        checksums = read_checksums(directory, meta["layout"]["world"], advice)
        if checksums[0] not in ALGORITHMS:
            notes.append(f"note: {directory} has {checksums[0]} checksums and this mpzero cannot compute them "
                         f"(pip install {checksums[0]}): loaded without verifying them")
    else:
        notes.append(f"note: {directory} has no checksums (format {meta.get('format', 1)}): loaded unverified")
    rng_state = None
    if load_rng:
        rng_state, note = _read_rng(directory, meta, groups, advice)
        notes += [note] if note else []
    return meta, checksums, rng_state, notes


def _load_failure(failure: dcp.CheckpointException, directory: str, advice: str, root: str, iteration: int) -> str:
    """One line for a failed collective read: a rank's own ConfigError (a checksum mismatch) as it is, else
    the first failed rank's error."""
    failures = failure.failures
    for rank in sorted(failures):
        error = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        if isinstance(error, ConfigError):
            return str(error)
    rank = min(failures) if failures else 0
    error = failures[rank][0] if failures and isinstance(failures[rank], tuple) else failures.get(rank, failure)
    return (f"checkpoint {directory}: reading its shards failed on rank {rank} ({error_reason(error)}): {advice}; "
            f"`tools/checkpoint_util.py verify --load {root} --iteration {iteration}` names the damaged file")


def _read_rng(directory: str, meta: dict, groups: ParallelGroups, advice: str):
    """(this rank's generator states, None), or (None, a note) at another layout: per-rank dropout streams
    only mean something at the layout that drew them. A missing or unreadable file at the same layout is a
    ConfigError naming it."""
    path = os.path.join(directory, "rng", f"rank_{groups.world.rank:05d}.pt")
    name = os.path.relpath(path, directory)
    layout = meta["layout"]
    if (layout.get("world"), layout.get("tp"), layout.get("pp", 1)) != (groups.world.size, groups.tp_size,
                                                                        groups.pp_size):
        return None, f"note: checkpoint layout {meta['layout']} has no RNG states for this run's: not loaded"
    if not os.path.isdir(os.path.dirname(path)):  # made by tools/checkpoint_util.py from-consolidated
        return None, f"note: {directory} holds no RNG states: not loaded"
    try:
        return torch.load(path, weights_only=True), None
    except FileNotFoundError:
        problem = "is missing"
    except Exception as error:  # noqa: BLE001 - a damaged pickle or zip raises anything
        problem = f"is unreadable ({error_reason(error)})"
    raise ConfigError(f"checkpoint {directory}: {name} {problem}: {advice}, or pass --no-load-rng to start fresh "
                      f"dropout streams")


def _check_same_architecture(meta: dict, architecture: dict, directory: str) -> None:
    """Megatron's check_checkpoint_args: e.g. 4 heads saved, 8 loaded, gives QKV rows of the same shape that
    mean something else. Checkpoints that predate meta["architecture"] are compared on their saved flags (where a
    flag left unset, such as --ffn-hidden-size, is compared through the shapes instead, and a setting this model
    does not use, such as --rotary-base without RoPE, not at all)."""
    saved = meta.get("architecture") or meta.get("config") or {}
    for name, value in architecture.items():  # None on either side: a default resolved elsewhere, or unused
        if value is not None and saved.get(name) is not None and saved[name] != value:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{directory} was saved with {flag} {saved[name]}, this run has {value}: the "
                              f"weights would mean something else; match the model flags or point --load elsewhere")


def global_shapes(where: dict[str, TensorPlacement], groups: ParallelGroups) -> dict[str, tuple[int, ...]]:
    """{name: the whole tensor's shape} of this rank's parameters (an expert stack's: every expert's)."""
    return {name: placement.global_shape(*_axes(placement, groups)[1::2]) for name, placement in where.items()}


def _axes(placement: TensorPlacement, groups: ParallelGroups) -> tuple[int, int, int, int]:
    """(TP rank, TP size, EP rank, EP size) a parameter is split over: an expert stack's TP group is expert-TP."""
    if placement.expert:
        return groups.expert_tp.rank, groups.expert_tp.size, groups.ep.rank, groups.ep.size
    return groups.tp_rank, groups.tp_size, 0, 1


def _check_same_model(meta: dict, here: dict[str, tuple[int, ...]], everywhere: set[str], directory: str) -> None:
    """The checkpoint's parameters are the model's (every stage's names; this stage's shapes)."""
    saved = {}
    for key, shape in meta["shapes"].items():
        state, name = parse_checkpoint_key(key)
        if state == MASTER:
            saved[name] = tuple(shape)
    for name in sorted(set(saved) | everywhere):
        if name in everywhere and name not in here and name in saved:
            continue  # another pipeline stage's: checked there
        if saved.get(name) != here.get(name):
            raise ConfigError(f"{directory} is from another model: {name} is {saved.get(name, 'absent')} there and "
                              f"{here.get(name, 'absent')} here; match the model flags or point --load elsewhere")


def _local_shares(optimizer, where: dict[str, TensorPlacement], keys: tuple[str, ...], groups: ParallelGroups,
                  writing: bool, skip: frozenset[str] = frozenset()) -> dict[str, LocalShare]:
    """{checkpoint key: this rank's chunks (views into the optimizer's state) of that global tensor} for `keys`
    among master and the update rule's states. TP-replicated parameters are written by TP rank 0 alone, a
    pipeline stage's copy of a tied parameter (`skip`) by the stage holding the original; an expert stack by every
    EP rank (its experts), replicated over expert-TP by expert-TP rank 0."""
    per_key: dict[str, LocalShare] = {}
    for piece in optimizer.owned_pieces():
        placement = where[piece.name]
        tp_rank, tp_size, ep_rank, ep_size = _axes(placement, groups)
        if writing and (piece.name in skip or (placement.partition_dim is None and tp_rank != 0)):
            continue
        for k in keys:
            share = per_key.setdefault(checkpoint_key(k, piece.name),
                                       LocalShare(placement.global_shape(tp_size, ep_size), []))
            share.chunks.extend(chunks(piece, k, placement, tp_rank, tp_size, ep_rank))
    return {key: share for key, share in per_key.items() if share.chunks}
