"""Finding and reading a Megatron-LM / Megatron-core checkpoint saved in the `torch_dist` format (torch's
distributed checkpoint, DCP), without running anything it holds.

Megatron-LM's --save directory holds `latest_checkpointed_iteration.txt` (an iteration or `release`) and one
directory per save, `iter_0000100/` (or `release/`); megatron-core's `dist_checkpointing.save` writes one such
directory: `metadata.json` (the format, plain JSON), DCP's `.metadata` and `__R_N.distcp` shards, and `common.pt`.
What is read here:
- metadata.json, as JSON: it must say `"sharded_backend": "torch_dist"`;
- `.metadata` through mpzero's restricted Unpickler (checkpointing/reader.py), which admits DCP's own record
  classes plus the save-plan records megatron-core's writer keeps there (`Metadata.all_local_plans`, for reuse
  at its next save): torch's plain SavePlan, WriteItem, TensorWriteData and BytesIOWriteData dataclasses and the
  WriteItemType enum (calling it looks a member up); any other name is refused before it is called;
- the tensors, each read whole by key (every TP and PP shard of it, whatever layout saved it) from the .distcp
  shards, which DCP reads with `torch.load(weights_only=True)`; byte items (`_extra_state`, RNG states) are never
  requested.
`common.pt` (the run's arguments, the iteration, the optimizer's scalar state) is a plain pickle that could run
code when loaded: it is never opened. The model's shape comes from the tensors and the user's flags instead.
Megatron's legacy `torch` format (`mp_rank_*/model_optim_rng.pt`, a pickle too) is refused the same way.
"""

from __future__ import annotations

import json
import os

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from mpzero.checkpointing import ADMITTED, CheckpointReader, ChunksLoadPlanner, check_shard_files, load_whole, \
    read_dcp_metadata
from mpzero.errors import ConfigError

TRACKER = "latest_checkpointed_iteration.txt"
FORMAT_FILE = "metadata.json"
MEGATRON_ADMITTED = ADMITTED | frozenset(
    ("torch.distributed.checkpoint.planner", name) for name in ("SavePlan", "WriteItem", "WriteItemType",
                                                               "TensorWriteData", "BytesIOWriteData"))
CONVERT_ADVICE = ("re-save it in the torch_dist format with Megatron-LM (--ckpt-convert-format torch_dist "
                  "--ckpt-convert-save DIR)")


def checkpoint_directory(load: str, step: int | None) -> str:
    """The directory of the DCP checkpoint under Megatron-LM's --save directory `load`: iteration `step`, else the
    one its tracker file names; or `load` itself when it is one saved checkpoint."""
    if not os.path.isdir(load):
        raise ConfigError(f"--load {load}: no such directory")
    if os.path.isfile(os.path.join(load, FORMAT_FILE)) or os.path.isfile(os.path.join(load, ".metadata")):
        if step is not None:
            raise ConfigError(f"--load {load} is one saved checkpoint, not a --save directory of iterations: "
                              f"drop --ckpt-step or pass the directory above it")
        return load
    if step is None:
        tracker = os.path.join(load, TRACKER)
        if not os.path.isfile(tracker):
            _refuse_legacy(load)
            raise ConfigError(f"--load {load} is not a Megatron checkpoint directory (no {TRACKER}, no "
                              f"{FORMAT_FILE}): pass Megatron-LM's --save directory or one iter_* directory in it")
        with open(tracker, "rb") as f:
            text = f.read(64).decode("utf-8", errors="replace").strip()
        if text != "release" and not (text.isascii() and text.isdigit()):
            raise ConfigError(f"{tracker} holds {text[:40]!r}, not an iteration number or 'release': fix it or "
                              f"pass --ckpt-step")
        name = "release" if text == "release" else f"iter_{int(text):07d}"
    else:
        name = f"iter_{step:07d}"
    directory = os.path.join(load, name)
    if not os.path.isdir(directory):
        raise ConfigError(f"--load {load} has no {name} directory: pass --ckpt-step with an iteration it holds")
    _refuse_legacy(directory)
    return directory


def _refuse_legacy(directory: str) -> None:
    """Megatron's legacy format (one pickle per model-parallel rank) is not read."""
    if any(name.startswith("mp_rank_") for name in os.listdir(directory)):
        raise ConfigError(f"{directory} is in Megatron's legacy torch format (mp_rank_*/model_optim_rng.pt, pickles "
                          f"that could run code when loaded): not read; {CONVERT_ADVICE}")


def read_metadata(directory: str) -> Metadata:
    """DCP's metadata of a torch_dist checkpoint, after metadata.json says that is its format and the shard
    files it points into are checked present and long enough."""
    path = os.path.join(directory, FORMAT_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            stated = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{directory} has no {FORMAT_FILE}: not a checkpoint megatron-core's dist_checkpointing "
                          f"saved") from None
    except (OSError, ValueError):
        raise ConfigError(f"{path} is unreadable or not JSON: the checkpoint is damaged") from None
    backend = stated.get("sharded_backend") if isinstance(stated, dict) else None
    if backend != "torch_dist":
        raise ConfigError(f"{directory} is in the {backend!r} format, not 'torch_dist': {CONVERT_ADVICE}")
    advice = "the checkpoint is damaged or incomplete: copy it again from where it was saved"
    metadata = read_dcp_metadata(directory, advice, MEGATRON_ADMITTED)
    check_shard_files(directory, metadata, advice)
    return metadata


def read_tensors(directory: str, metadata: Metadata, keys: list[str]) -> dict[str, torch.Tensor]:
    """The stored tensors `keys`, each whole at its global shape and stored dtype."""
    stored = metadata.state_dict_metadata
    tensors = {}
    for key in keys:
        md = stored[key]
        assert isinstance(md, TensorStorageMetadata), key  # the caller picks tensor keys
        tensors[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    load_whole(tensors, CheckpointReader(directory, MEGATRON_ADMITTED), ChunksLoadPlanner(None, directory),
               "the checkpoint is damaged: copy it again from where it was saved")
    return tensors
