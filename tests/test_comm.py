"""mpzero/comm.py's point-to-point and all-to-all on forked gloo ranks: what arrives, and the bytes counted (what
each rank sends). The collectives of ZeRO and TP are held by tests/test_parallel.py and the layout tests."""

import pytest
import torch

from mpzero.parallel import init_parallel
from tests.distributed import run_ranks


def _ring_exchange():
    """Each rank sends its vector to the next and receives the previous one's, both posted at once."""
    world = init_parallel(1).world
    nxt, prev = (world.rank + 1) % world.size, (world.rank - 1) % world.size
    mine, theirs = torch.full((3,), float(world.rank)), torch.empty(3)
    world.exchange(sends=[(mine, nxt)], recvs=[(theirs, prev)])
    return theirs.tolist(), dict(world.stats.bytes), dict(world.stats.calls)


def test_exchange_delivers_and_counts_the_bytes_sent():
    results = run_ranks(3, _ring_exchange)
    assert [r[0] for r in results] == [[2.0] * 3, [0.0] * 3, [1.0] * 3]
    assert all(r[1] == {"send": 12.0} and r[2] == {"send": 1} for r in results)


def _uneven_all_to_all():
    """Rank r sends r + 1 rows to every peer (one row of 2 floats each); ranks receive 1, 2, 3 rows from 0, 1, 2."""
    world = init_parallel(1).world
    r, n = world.rank, world.size
    sent = torch.full((n * (r + 1), 2), float(r))
    received = torch.empty(sum(q + 1 for q in range(n)), 2)
    world.all_to_all_single(received, sent, [q + 1 for q in range(n)], [r + 1] * n)
    return received[:, 0].tolist(), world.stats.bytes["all_to_all"]


def test_all_to_all_with_uneven_splits_counts_what_leaves_the_rank():
    results = run_ranks(3, _uneven_all_to_all)
    assert all(r[0] == [0.0, 1.0, 1.0, 2.0, 2.0, 2.0] for r in results)
    # rank r keeps r + 1 rows of 8 bytes and sends 2 (r + 1)
    assert [r[1] for r in results] == [16.0, 32.0, 48.0]


def _send_a_view():
    world = init_parallel(1).world
    with pytest.raises(ValueError, match="not contiguous"):
        world.exchange(sends=[(torch.zeros(4, 4).t(), 1 - world.rank)])
    return dict(world.stats.bytes)


def test_a_view_handed_to_a_collective_is_refused():
    assert run_ranks(2, _send_a_view) == [{}, {}]
