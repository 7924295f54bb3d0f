import pytest
import torch

from mpzero.errors import ConfigError
from mpzero.parallel import GridSizes, init_parallel, rank_grid
from tests.distributed import RanksFailed, run_ranks


def test_rank_grid_matches_megatron_layout():
    grid = rank_grid(8, GridSizes(tp=2))
    assert grid["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid["dp"] == grid["dp_cp"] == grid["expert_dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert grid["pp"] == grid["cp"] == grid["ep"] == [[r] for r in range(8)]
    four = rank_grid(4, GridSizes(tp=4))
    assert (four["tp"], four["dp"]) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])


def test_rank_grid_matches_megatrons_documented_3d_example():
    """Megatron's `initialize_model_parallel` docstring: 16 GPUs, TP 2, PP 4 (so DP 2)."""
    grid = rank_grid(16, GridSizes(tp=2, pp=4))
    assert grid["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert grid["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert grid["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert grid["embedding"] == [[0, 12], [1, 13], [2, 14], [3, 15]]


def test_context_and_expert_axes_follow_megatrons_order():
    """tp-cp-ep-dp-pp: CP between TP and DP; ZeRO's group spans DP x CP; EP folds into the CP x DP ranks
    (adjacent ones), expert-DP takes the rest."""
    grid = rank_grid(16, GridSizes(tp=2, cp=2, pp=2))
    assert grid["cp"][:2] == [[0, 2], [1, 3]]
    assert grid["dp"][:2] == [[0, 4], [1, 5]]
    assert grid["dp_cp"][:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert grid["pp"][:2] == [[0, 8], [1, 9]]
    assert grid["embedding"][:3] == [[0, 8], [1, 9], [2, 10]]  # each TP x CP x DP index its own tied pair
    experts = rank_grid(8, GridSizes(ep=4))
    assert experts["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert experts["expert_dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert experts["dp"] == [list(range(8))]


def test_expert_tensor_parallel_one_folds_experts_over_the_tensor_parallel_ranks_too():
    """Megatron's expert grid etp-ep-edp-pp over the same ranks: at ETP 1 an EP group takes adjacent ranks, TP
    pairs included (TP 2, DP 2, EP 4: all four ranks); at ETP = TP (the default) the expert-TP group is the TP
    group and EP folds into the DP ranks."""
    folded = rank_grid(8, GridSizes(tp=2, ep=4, etp=1))
    assert folded["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert folded["expert_dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert folded["expert_tp"] == [[r] for r in range(8)]
    default = rank_grid(8, GridSizes(tp=2, ep=2))
    assert default["expert_tp"] == default["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert default["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert default["expert_dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_every_axis_partitions_the_world():
    for sizes, world in ((GridSizes(tp=2, pp=2, cp=2, ep=2), 16), (GridSizes(pp=4), 8), (GridSizes(tp=4, ep=2), 8),
                         (GridSizes(tp=2, cp=2, ep=8, etp=1), 16)):
        for name, groups in rank_grid(world, sizes).items():
            if name != "embedding":
                assert sorted(r for g in groups for r in g) == list(range(world)), name


@pytest.mark.parametrize("world, sizes, message", [
    (6, GridSizes(tp=4), "world size 6 is not divisible by --tensor-model-parallel-size 4"),
    (8, GridSizes(tp=2, pp=3), "world size 8 is not divisible by TP 2 x CP 1 x PP 3 = 6"),
    (8, GridSizes(tp=2, ep=3), "--expert-model-parallel-size 3 does not divide the 4 context- and data-parallel"),
    (8, GridSizes(pp=0), "--pipeline-model-parallel-size 0 must be positive"),
    (8, GridSizes(tp=2, ep=3, etp=1), "--expert-tensor-parallel-size 1 x --expert-model-parallel-size 3 does not "
                                      "divide the 8 tensor-, context- and data-parallel ranks"),
    (8, GridSizes(tp=2, etp=0), "--expert-tensor-parallel-size 0 must be positive")])
def test_a_grid_that_does_not_divide_the_world_is_one_line_error(world, sizes, message):
    with pytest.raises(ConfigError, match=message.replace("+", r"\+")):
        rank_grid(world, sizes)


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


def _pipeline_groups():
    groups = init_parallel(1, pp_size=2)
    total = torch.tensor([float(groups.world.rank)])
    groups.pp.all_reduce(total)
    return groups.pp.ranks, groups.pp_rank, groups.is_first_stage, groups.is_last_stage, groups.is_logging_rank, \
        groups.dp.ranks, groups.embedding.ranks, total.item(), groups.cp.pg is None


def test_pipeline_groups_from_a_running_world():
    results = run_ranks(4, _pipeline_groups)
    assert [r[:5] for r in results] == [((0, 2), 0, True, False, False), ((1, 3), 0, True, False, False),
                                        ((0, 2), 1, False, True, True), ((1, 3), 1, False, True, False)]
    assert [r[5:] for r in results] == [((0, 1), (0, 2), 2.0, True), ((0, 1), (1, 3), 4.0, True),
                                        ((2, 3), (0, 2), 2.0, True), ((2, 3), (1, 3), 4.0, True)]


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
