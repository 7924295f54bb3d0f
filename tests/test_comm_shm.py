"""mpzero/comm_shm.py: a pipeline's point-to-point through shared memory on forked gloo ranks of one host. What
arrives, in each tag's order, also when the receiver waits out of order and its ring is full (the sender queues, so
waiting on one tag never stalls the other); bytes counted as through gloo; a missing message a timeout error and a
peer that exits an error within seconds, never a hang; nothing left in /dev/shm; the ranks of two hosts, and a file
that is not what its receiver made, refused."""

import dataclasses
import os

import pytest
import torch

import mpzero.comm_shm as comm_shm
from mpzero.parallel import init_parallel
from tests.distributed import RanksFailed, run_ranks
from tests.peer_exit import exit_or_wait, waited

pytestmark = pytest.mark.skipif(not comm_shm.shared_memory_usable(), reason="no x86-64 /dev/shm here")

_NBYTES = 64 * 4


def _group(timeout: float = 60.0):
    world = init_parallel(1).world
    p2p, why = comm_shm.open_shared_memory_p2p(world, _NBYTES, tags=2, timeout=timeout)
    assert p2p is not None, why
    return dataclasses.replace(world, p2p=p2p)


def _out_of_order():
    """Rank 0 sends five activations (tag 0) then one gradient (tag 1) into rings of two slots; rank 1 waits for
    the gradient first, then for the activations last to first."""
    group = _group()
    if group.rank == 0:
        sends = [(torch.full((64,), float(i)), 1) for i in range(5)] + [(torch.full((32,), -1.0), 1)]
        requests = group.exchange(sends=sends, async_op=True, tags=[0] * 5 + [1])
        for request in requests:
            request.wait()
        return None, dict(group.stats.bytes)
    received = [torch.empty(64) for _ in range(5)] + [torch.empty(32)]
    requests = group.exchange(recvs=[(t, 0) for t in received], async_op=True, tags=[0] * 5 + [1])
    for request in reversed(requests):
        request.wait()
    return [t[0].item() for t in received[:5]] + [received[-1].sum().item()], dict(group.stats.bytes)


def test_messages_arrive_in_each_tags_order_when_the_ring_is_full_and_waits_are_reversed():
    sender, receiver = run_ranks(2, _out_of_order)
    assert receiver[0] == [0.0, 1.0, 2.0, 3.0, 4.0, -32.0]
    assert sender[1] == {"send": 5 * 256 + 128} and receiver[1] == {}


def _both_ways():
    group = _group()
    other = 1 - group.rank
    out = []
    for step in range(6):  # each message sent while the other rank may still be reading the last
        mine, theirs = torch.full((64,), float(10 * group.rank + step)), torch.empty(64)
        group.exchange(sends=[(mine, other)], recvs=[(theirs, other)], tags=[step % 2, step % 2])
        out.append(theirs[0].item())
    return out


def test_two_ranks_exchange_both_ways_as_gloo_does():
    assert run_ranks(2, _both_ways) == [[10.0 + s for s in range(6)], [float(s) for s in range(6)]]


def _never_sent():
    group = _group(timeout=0.5)
    if group.rank == 0:
        return "sent nothing"
    request = group.exchange(recvs=[(torch.empty(64), 0)], async_op=True, tags=[0])[0]
    with pytest.raises(comm_shm.P2PTimeout, match="waited 0 s for group rank 0 .* stopped or is stuck"):
        request.wait()
    return "timed out"


def test_a_message_that_never_comes_is_a_timeout_error():
    assert run_ranks(2, _never_sent) == ["sent nothing", "timed out"]


def _exits(report: str):
    group = _group(timeout=60.0)
    exit_or_wait(report, group.rank, lambda: group.exchange(recvs=[(torch.empty(64), 0)], tags=[0]))


def test_a_peer_that_exits_is_an_error_within_seconds_not_the_timeout(tmp_path):
    with pytest.raises(RanksFailed, match="rank 0 ---\nprocess died"):
        run_ranks(2, _exits, str(tmp_path / "report"), deadline=30)
    seconds, message = waited(tmp_path / "report")
    assert seconds < 5 and message.endswith("has exited") and "for group rank 0" in message


def _files_and_hosts(split: bool):
    world = init_parallel(1).world
    before = {n for n in os.listdir(comm_shm.SHM_DIR) if n.startswith("mpzero-shm-")}
    if split and world.rank == 1:
        comm_shm._host = lambda: "another-host/boot"
    p2p, why = comm_shm.open_shared_memory_p2p(world, _NBYTES, tags=2, timeout=10.0)
    world.all_gather_objects(None)  # every rank past its unlinks
    after = {n for n in os.listdir(comm_shm.SHM_DIR) if n.startswith("mpzero-shm-")}
    return p2p is not None, why, sorted(after - before)


def test_the_rings_leave_no_file_and_two_hosts_keep_gloo():
    assert run_ranks(3, _files_and_hosts, False) == [(True, None, [])] * 3
    results = run_ranks(2, _files_and_hosts, True)
    assert all(not made and "not all on one x86-64 host" in why and left == [] for made, why, left in results)


def test_a_file_not_made_by_its_receiver_is_refused(tmp_path):
    wrong = tmp_path / "short"
    wrong.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="is not the 128-byte file of this user"):
        comm_shm._attach(str(wrong), 128)
    link = tmp_path / "link"
    link.symlink_to(wrong)
    with pytest.raises(OSError):  # O_NOFOLLOW: a planted link is not followed
        comm_shm._attach(str(link), 64)
