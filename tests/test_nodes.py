"""mpzero/nodes.py without torchrun: the `nodes:` line from a rank -> node map, and the shared-directory check on
forked gloo ranks (a per-rank path stands for a node-local disk). tests/test_multinode.py runs real agents."""

import os

import pytest

from mpzero.errors import ConfigError
from mpzero.nodes import check_shared_directory, node_layout_line
from mpzero.parallel import GridSizes, init_parallel, rank_grid
from tests.distributed import run_ranks


def test_tp_groups_tile_nodes_when_processes_per_node_are_a_multiple_of_tp():
    nodes = ["a"] * 4 + ["b"] * 4  # torchrun numbers ranks node by node
    assert node_layout_line(nodes, rank_grid(8, GridSizes(tp=2))) == \
        "nodes: 2 (4 processes each) | TP groups inside a node | DP groups across 2 node(s)"
    assert node_layout_line(nodes, rank_grid(8, GridSizes(tp=4))).endswith("DP groups across 2 node(s)")
    assert node_layout_line(nodes, rank_grid(8, GridSizes(tp=8))) == \
        "nodes: 2 (4 processes each) | warning: 1 TP group(s) span nodes (e.g. ranks [0, 1, 2, 3, 4, 5, 6, 7]): " \
        "their all-reduces cross the network; launch a multiple of the TP size per node | DP groups across 1 node(s)"


def test_a_tp_group_across_a_node_boundary_is_named():
    nodes = ["a"] * 6 + ["b"] * 6  # 6 per node, TP 4: ranks 4-7 straddle the boundary
    line = node_layout_line(nodes, rank_grid(12, GridSizes(tp=4)))
    assert "warning: 1 TP group(s) span nodes (e.g. ranks [4, 5, 6, 7])" in line


def test_uneven_nodes_are_counted():
    assert node_layout_line(["a", "a", "a", "b"], rank_grid(4, GridSizes(tp=1))).startswith("nodes: 2 (processes 3+1)")


def _check(paths):
    groups = init_parallel(1)
    path = paths[groups.world.rank]
    try:
        check_shared_directory(groups.world, path, "--save")
    except ConfigError as error:
        return str(error), sorted(os.listdir(path))
    return None, sorted(os.listdir(path))


def test_a_directory_every_rank_sees_passes_and_is_left_as_found(tmp_path):
    shared = str(tmp_path)
    assert run_ranks(2, _check, [shared, shared]) == [(None, []), (None, [])]


def test_a_directory_one_rank_does_not_see_is_refused_on_every_rank(tmp_path):
    local = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    for path in local:
        os.mkdir(path)
    results = run_ranks(2, _check, local)
    for rank, (error, left) in enumerate(results):
        assert error is not None and left == [], "refused on every rank, the marker removed"
        assert f"--save {local[rank]} is not one directory for every rank: rank 1 (node " in error
        assert "checkpoints need a file system every node mounts" in error


def _check_nodes(save):
    from mpzero.nodes import check_nodes
    return check_nodes(init_parallel(1).world, 1, save, None)


@pytest.mark.parametrize("world", [1])
def test_a_world_of_one_has_nothing_to_check(world, tmp_path):
    assert run_ranks(world, _check_nodes, str(tmp_path)) == [None]
