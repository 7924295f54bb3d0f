"""mpzero/comm_shm_collectives.py through CommGroup on forked gloo ranks of one host: sums in rank order (every rank
the same bits, equal to the sum in order 0, 1, ... computed on one rank), over several chunks, uneven slices, in place;
what cannot go through shared memory (a max, ranks of two hosts) stays on gloo; a peer that exits an error within
seconds; no file left in /dev/shm."""

import os

import pytest
import torch
import torch.distributed as dist

import mpzero.comm_shm as comm_shm
from mpzero.comm_shm_collectives import CHUNK
from mpzero.parallel import init_parallel
from tests.distributed import RanksFailed, run_ranks
from tests.peer_exit import exit_or_wait, waited

pytestmark = pytest.mark.skipif(not comm_shm.shared_memory_usable(), reason="no x86-64 /dev/shm here")

_NUMEL = CHUNK // 4 + 1001  # fp32: two chunks, the second short


def _inputs(rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    values = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    return (values * 100).to(torch.int64) if dtype == torch.int64 else values.to(dtype)


def _in_rank_order(size: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    total = _inputs(0, dtype, numel)
    for rank in range(1, size):
        total = total + _inputs(rank, dtype, numel)
    return total


def _collectives(dtype: torch.dtype):
    world = init_parallel(1).world
    size, rank = world.size, world.rank
    summed = _inputs(rank, dtype, _NUMEL)
    world.all_reduce(summed)
    full = _inputs(rank, dtype, size * _NUMEL)
    shard = torch.empty(_NUMEL, dtype=dtype)
    request = world.reduce_scatter_into(shard, full, async_op=True)
    request.wait()
    gathered = torch.empty(size * _NUMEL, dtype=dtype)
    world.all_gather_into(gathered, shard)
    in_place = _inputs(rank, dtype, size * 5)
    world.all_gather_into(in_place, in_place[rank * 5:(rank + 1) * 5])
    return (world.shared.opened is not None, summed, gathered, in_place, dict(world.stats.bytes))


@pytest.mark.parametrize("world,dtype", [(2, torch.float32), (3, torch.bfloat16), (4, torch.int64)])
def test_sums_and_gathers_equal_the_sums_in_rank_order_on_every_rank(world, dtype):
    results = run_ranks(world, _collectives, dtype)
    assert all(opened for opened, *_ in results)
    summed = _in_rank_order(world, dtype, _NUMEL)
    scattered = _in_rank_order(world, dtype, world * _NUMEL)
    for _, mine, gathered, in_place, nbytes in results:
        assert torch.equal(mine, summed) and torch.equal(gathered, scattered)
        assert torch.equal(in_place, torch.cat([_inputs(r, dtype, world * 5)[r * 5:(r + 1) * 5] for r in range(world)]))
        element = summed.element_size()
        assert nbytes == {"all_reduce": 2 * _NUMEL * element * (world - 1) / world,
                          "reduce_scatter": (world - 1) * _NUMEL * element,
                          "all_gather": (world - 1) * (_NUMEL + 5) * element}


def _max_and_hosts(split: bool):
    if split and dist.get_rank() == 1:
        comm_shm._host = lambda: "another-host/boot"
    world = init_parallel(1).world
    before = {n for n in os.listdir(comm_shm.SHM_DIR) if n.startswith("mpzero-shm-")}
    biggest = torch.tensor([float(world.rank)])
    world.all_reduce(biggest, op=dist.ReduceOp.MAX)  # gloo: not a sum
    untried = not world.shared.tried
    total = torch.ones(3)
    world.all_reduce(total)
    world.all_gather_objects(None)  # every rank past its unlinks
    after = {n for n in os.listdir(comm_shm.SHM_DIR) if n.startswith("mpzero-shm-")}
    return untried, world.shared.opened is not None, biggest.item(), total.tolist(), sorted(after - before)


def test_a_max_and_the_ranks_of_two_hosts_stay_on_gloo_and_no_file_is_left():
    assert run_ranks(2, _max_and_hosts, False) == [(True, True, 1.0, [2.0] * 3, [])] * 2
    assert run_ranks(2, _max_and_hosts, True) == [(True, False, 1.0, [2.0] * 3, [])] * 2


def _exits(report: str):
    world = init_parallel(1).world
    world.all_reduce(torch.ones(4))  # opens the shared memory
    exit_or_wait(report, world.rank, lambda: world.all_reduce(torch.ones(4)))


def test_a_peer_that_exits_is_an_error_within_seconds(tmp_path):
    with pytest.raises(RanksFailed, match="rank 0 ---\nprocess died"):
        run_ranks(2, _exits, str(tmp_path / "report"), deadline=30)
    seconds, message = waited(tmp_path / "report")
    assert seconds < 5 and message.endswith("has exited") and "an all-reduce's inputs" in message
