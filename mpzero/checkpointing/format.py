"""The names a checkpoint is made of, shared by the trainer and tools/checkpoint_util.py.

Format 1 (no "format" field in meta.json) and format 2 store the same tensors under the same keys and chunks;
format 2 is written through mpzero's own DCP planners instead of torch's deprecated sharded-tensor class, and
says so in meta.json, so that a later change of layout can be told apart and refused or converted.
Format 3 adds checksums/rank_NNNNN.json, a checksum of every stored chunk (checksums.py), and says its
algorithm in meta.json ("checksums"); formats 1 and 2 still load, unverified.
"""

from __future__ import annotations

import os

from mpzero.optim import STATE_NAMES

FORMAT = 3
LATEST = "latest_checkpointed_iteration.txt"
TMP_SUFFIX = ".tmp"  # iter_0000100.tmp: a save being written (or killed while it was)
OLD_SUFFIX = ".old"  # iter_0000100.old: a checkpoint of the same iteration being replaced
MASTER = "master"
RULE_BEFORE_NAMED = "adam"  # meta["optimizer"] names its update rule ("rule"); checkpoints from before were AdamW


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def published_dir(root: str, iteration: int) -> str:
    """Where published checkpoint `iteration` is read from: `iter_N`, or `iter_N.old` while `iter_N` is missing
    (a save of the same iteration again stopped between its two renames: files.replace_directory)."""
    final = checkpoint_dir(root, iteration)
    aside = final + OLD_SUFFIX
    return aside if not os.path.lexists(final) and os.path.isdir(aside) else final


def checkpoint_key(state: str, name: str) -> str:
    """model/<name> for the fp32 weights (state "master"), optimizer/<state>/<name> for an update rule's state
    (mpzero.optim: exp_avg and exp_avg_sq for AdamW, momentum_buffer for SGD)."""
    if state == MASTER:
        return f"model/{name}"
    if state in STATE_NAMES:
        return f"optimizer/{state}/{name}"
    raise ValueError(f"no checkpoint key for state {state!r}: expected {MASTER!r} or one of {STATE_NAMES}")


def parse_checkpoint_key(key: str) -> tuple[str, str]:
    """(state, parameter name) of a checkpoint key: the inverse of checkpoint_key."""
    kind, _, rest = key.partition("/")
    if kind == "model" and rest:
        return MASTER, rest
    if kind == "optimizer":
        state, _, name = rest.partition("/")
        if state in STATE_NAMES and name:
            return state, name
    raise ValueError(f"{key!r} is not a checkpoint key (model/<name> or optimizer/<state>/<name>)")
