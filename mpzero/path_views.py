"""Every rank sees the same --load, --save and --offload-path, compared at start (issue 42).

A path that exists on one node and not on another (a checkpoint copied to one machine only, a mount missing on
one) used to make the ranks take different branches: the ones that saw a checkpoint entered the load's
collectives, the others trained from scratch, and all of them waited out the distributed timeout (10 minutes)
before blaming a dead peer. Here each rank says what it sees and the views are compared in one small exchange:
a disagreement is one ConfigError line on every rank, naming the flag and which ranks see what, within seconds.

What is compared: for --load and --save, whether the path is a directory and the latest iteration its pointer
names (node-local copies of a checkpoint that disagree are no shared directory either); for --offload-path (often
a node-local disk, so its contents may differ), whether it is a directory.
"""

from __future__ import annotations

import os

from mpzero.checkpointing import latest_iteration
from mpzero.errors import ConfigError

CHECKPOINT_FLAGS = ("--load", "--save")
COMPARED_FLAGS = {"--load": "load", "--save": "save", "--offload-path": "offload_path"}  # flag: its dest


def path_view(flag: str, path: str) -> str:
    """What this rank sees at `path`, in words that are equal exactly when two ranks see the same."""
    if not os.path.lexists(path):
        return "no such path"
    if not os.path.isdir(path):
        return "no directory"
    if flag not in CHECKPOINT_FLAGS:
        return "a directory"
    try:
        latest = latest_iteration(path)
    except (ConfigError, OSError):
        return "a damaged latest-iteration pointer"
    return f"checkpoints up to iteration {latest}" if latest is not None else "a directory without checkpoints"


def check_same_views(world, flags: dict) -> None:
    """Collective: every rank of `world` (a CommGroup) compares its view of each path of COMPARED_FLAGS that
    `flags` ({dest: value}, a run's resolved flags) gives with every other rank's; the first flag they disagree
    on is a ConfigError on all of them."""
    given = {flag: flags.get(dest) for flag, dest in COMPARED_FLAGS.items() if flags.get(dest)}
    if world.size == 1 or not given:
        return
    views = world.all_gather_objects({flag: path_view(flag, path) for flag, path in given.items()})
    for flag, path in given.items():
        seen: dict[str, list[int]] = {}
        for rank, view in enumerate(views):
            seen.setdefault(view[flag], []).append(rank)
        if len(seen) > 1:
            sides = "; ".join(f"{_ranks(ranks)} see{'s' if len(ranks) == 1 else ''} {view}"
                              for view, ranks in seen.items())
            raise ConfigError(f"{flag} {path} is not the same for every rank: {sides}. Every node must see one "
                              f"{flag} (a file system all nodes mount, or the same copy on each)")


def _ranks(ranks: list[int]) -> str:
    """'rank 2', 'ranks 0-3', 'ranks 0, 2, 5'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))
