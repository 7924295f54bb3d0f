"""What differs when the ranks span machines: which node each rank runs on, and whether a checkpoint directory is
one directory for all of them.

torchrun numbers ranks node by node (`--nnodes 2 --nproc-per-node 4`: ranks 0-3 on the first node to join, 4-7 on
the next), and `rank_grid` (parallel.py) makes tensor-parallel groups of adjacent ranks, so a TP group stays inside
a node, on its fast links, whenever the processes per node are a multiple of the TP size; data-parallel groups
are strided and cross nodes. `node_layout_line` says so at start (and warns when a TP group spans nodes).

A node is its host name and torchrun's GROUP_RANK (its node rank), so two torchrun agents on one machine, as the
tests run them, are two nodes.

Checkpoints: every rank writes its own shards under `--save` and rank 0 publishes the iteration (renames the
directory, moves the latest pointer), so `--save` and `--load` must be one directory seen by every rank (a shared
file system: NFS, Lustre, GPFS, ...). A node-local path would leave the other nodes' shards where rank 0 never
sees them: a checkpoint that cannot load. `check_shared_directory` refuses that at start.
"""

from __future__ import annotations

import os
import socket
import uuid

from mpzero.errors import ConfigError


def this_node() -> str:
    """'host' or 'host/node-rank' when torchrun runs several agents (GROUP_RANK is the agent's node rank)."""
    host, group_rank = socket.gethostname(), os.environ.get("GROUP_RANK")
    return host if group_rank is None else f"{host}/{group_rank}"


def node_layout_line(nodes: list[str], grid: dict[str, list[list[int]]]) -> str:
    """One line describing where the groups of `grid` (`parallel.rank_grid`) run; `nodes[r]` is global rank r's
    node."""
    tp_groups, dp_groups = grid["tp"], grid["dp"]
    order = list(dict.fromkeys(nodes))  # nodes in rank order
    counts = [nodes.count(n) for n in order]
    per_node = f"{counts[0]} processes each" if len(set(counts)) == 1 else "processes " + "+".join(map(str, counts))
    split = [g for g in tp_groups if len({nodes[r] for r in g}) > 1]
    dp_nodes = max(len({nodes[r] for r in g}) for g in dp_groups)
    tp = ("TP groups inside a node" if not split else
          f"warning: {len(split)} TP group(s) span nodes (e.g. ranks {split[0]}): their all-reduces cross the "
          f"network; launch a multiple of the TP size per node")
    line = f"nodes: {len(order)} ({per_node}) | {tp} | DP groups across {dp_nodes} node(s)"
    if len(grid["pp"][0]) > 1:
        line += f" | PP groups across {max(len({nodes[r] for r in g}) for g in grid['pp'])} node(s)"
    return line


def check_shared_directory(world, path: str, flag: str) -> None:
    """Every rank of `world` (a CommGroup) must see `path` as the same directory: rank 0 leaves a marker file
    in it, the others look for it. A ConfigError on every rank otherwise (collective: call it on all ranks)."""
    token = world.all_gather_objects(uuid.uuid4().hex if world.rank == 0 else None)[0]
    marker = os.path.join(path, f".mpzero-shared-{token}")

    def leave_marker():
        if world.rank == 0:
            with open(marker, "x"):
                pass
    try:
        _, error = world.run_agreed(leave_marker, (OSError,))
        if error:
            raise ConfigError(f"{flag} {path}: cannot write a marker file there ({error})")
        seen = world.all_gather_objects((os.path.exists(marker), this_node()))
    finally:
        world.all_gather_objects(None)  # everyone has looked before rank 0 removes the marker
        if world.rank == 0 and os.path.exists(marker):
            os.remove(marker)
        world.all_gather_objects(None)  # and it is gone before any rank goes on
    blind = [(rank, node) for rank, (found, node) in enumerate(seen) if not found]
    if blind:
        rank, node = blind[0]
        raise ConfigError(f"{flag} {path} is not one directory for every rank: rank {rank} (node {node}) does not "
                          f"see the file rank 0 wrote there; checkpoints need a file system every node mounts "
                          f"(NFS, Lustre, ...), or each node would keep only its own shards")


def check_nodes(world, sizes, save: str | None, load: str | None) -> str | None:
    """At start, on every rank: `--save` and `--load` shared by all ranks; returns the `nodes:` line when the
    ranks span more than one node (None on one node: nothing to say). `sizes`: the grid's (`parallel.GridSizes`)."""
    from mpzero.parallel import rank_grid

    if world.size == 1:
        return None
    nodes = world.all_gather_objects(this_node())
    if save:
        check_shared_directory(world, save, "--save")
    if load and (not save or os.path.realpath(load) != os.path.realpath(save)):
        if world.all_gather_objects(os.path.isdir(load))[0]:  # rank 0's view; none: no checkpoint to load
            check_shared_directory(world, load, "--load")
    if len(set(nodes)) == 1:
        return None
    return node_layout_line(nodes, rank_grid(world.size, sizes))
