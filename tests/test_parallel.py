import pytest
import torch

from mpzero.errors import ConfigError
from mpzero.parallel import init_parallel, rank_grid
from tests.distributed import RanksFailed, run_ranks


def test_rank_grid_matches_megatron_layout():
    tp_groups, dp_groups = rank_grid(8, 2)
    assert tp_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dp_groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert rank_grid(4, 4) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])


def test_world_not_divisible_by_tp_is_one_line_error():
    with pytest.raises(ConfigError, match="world size 6 is not divisible by --tensor-model-parallel-size 4"):
        rank_grid(6, 4)


def _groups_and_sums(tp_size):
    groups = init_parallel(tp_size)
    rank = groups.world.rank
    tp_sum, dp_sum = torch.tensor([float(rank)]), torch.tensor([float(rank)])
    groups.tp.all_reduce(tp_sum)
    groups.dp.all_reduce(dp_sum)
    return groups.tp.ranks, groups.dp.ranks, groups.tp_rank, groups.dp_rank, tp_sum.item(), dp_sum.item()


def test_groups_from_a_running_world():
    results = run_ranks(4, _groups_and_sums, 2)
    assert [r[:4] for r in results] == [((0, 1), (0, 2), 0, 0), ((0, 1), (1, 3), 1, 0),
                                        ((2, 3), (0, 2), 0, 1), ((2, 3), (1, 3), 1, 1)]
    assert [r[4:] for r in results] == [(1, 2), (1, 4), (5, 2), (5, 4)]


def _collectives_roundtrip():
    groups = init_parallel(1)
    dp = groups.dp
    full = torch.arange(8.0) * (dp.rank + 1)
    shard = torch.empty(4)
    dp.reduce_scatter_into(shard, full)
    gathered = torch.empty(8)
    dp.all_gather_into(gathered, shard)
    return gathered, dict(dp.stats.bytes)


def test_collectives_compute_and_count_ring_bytes():
    gathered, counted = run_ranks(2, _collectives_roundtrip)[0]
    torch.testing.assert_close(gathered, torch.arange(8.0) * 3)
    # 8 fp32 = 32 bytes full tensor; ring moves half of it per rank for each collective
    assert counted == {"reduce_scatter": 16.0, "all_gather": 16.0}


def _hang_on_missing_peer():
    groups = init_parallel(1, timeout_minutes=0.05)
    if groups.world.rank == 0:
        groups.dp.all_reduce(torch.ones(1))  # the dp group carries the short timeout


def test_collective_with_a_missing_peer_times_out_instead_of_hanging():
    with pytest.raises(RanksFailed, match="rank 0"):
        run_ranks(2, _hang_on_missing_peer, deadline=40)
