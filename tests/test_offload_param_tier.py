"""The parameter tier of stage-3 offload on its own (mpzero/zero/offload/params.py's ParamTier): the disk tier writes
each unit's region whole, whatever pieces the store sends and in whatever order; the staging slots are bounded and
reads ahead give way to a unit needed now; on a GPU, copies respect the compute stream."""

import multiprocessing as mp
import os

import pytest
import torch
from torch import nn

from mpzero.errors import ConfigError
from mpzero.zero import OffloadConfig
from mpzero.zero.flat import build_layout
from mpzero.zero.meter import TransientMeter
from mpzero.zero.offload.params import ParamTier, _covers
from mpzero.zero.offload.swap import round_up


def _world_of_one(fn, *args):
    """fn(*args) in a fresh process (spawned: CUDA does not survive a fork) in an NCCL world of one."""
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)

def _tier(tmp_path, staging, numels=(5000, 300)):
    params = [nn.Parameter(torch.zeros(n)) for n in numels]
    layouts = [build_layout([(f"p{i}", p)], 1, 0) for i, p in enumerate(params)]
    offload = OffloadConfig(optimizer="disk", params="disk", path=str(tmp_path))
    return ParamTier(layouts, torch.bfloat16, "cpu", offload, str(tmp_path / "rank00000"), TransientMeter(), staging)


def _read_back(tier, u):
    out = torch.empty(tier.numels[u], dtype=tier.dtype)
    tier.fetch(u, into=out).wait()
    tier.done(u)
    return out


def test_disk_tier_writes_each_unit_whole_from_pieces_in_any_order(tmp_path):
    tier = _tier(tmp_path, staging=False)
    values = [torch.randn(n).to(torch.bfloat16) for n in tier.numels]
    for u, v in enumerate(values):  # in order, in pieces: one write per unit, when the last piece arrives
        for start in range(0, v.numel(), 1000):
            tier.write(u, start, v[start:start + 1000].float())
    tier.flush()
    assert tier.traffic().disk_written == sum(round_up(2 * n) for n in tier.numels)
    assert all(torch.equal(_read_back(tier, u), v) for u, v in enumerate(values))
    # Out of order, and a unit left partly unwritten: what is not written keeps its stored values.
    new = values[0].clone()
    new[4000:].add_(1)
    new[:1000].sub_(1)
    tier.write(0, 4000, new[4000:])
    tier.write(0, 0, new[:1000])
    tier.write(1, 0, values[1][:10])  # another unit: the first one is written out
    tier.flush()
    assert torch.equal(_read_back(tier, 0), new) and torch.equal(_read_back(tier, 1), values[1])
    path = tier._file.path
    tier.close()
    assert not os.path.exists(path)


def test_staging_slots_are_bounded_and_reads_ahead_give_way(tmp_path):
    tier = _tier(tmp_path, staging=True, numels=(100, 200, 300))
    values = [torch.full((n,), float(n)).to(torch.bfloat16) for n in tier.numels]
    for u, v in enumerate(values):
        tier.write(u, 0, v)
    tier.flush()
    tier.read_ahead(0)
    tier.read_ahead(1)
    tier.read_ahead(2)  # no free slot: skipped
    assert sorted(s.unit for s in tier._slots) == [0, 1] and tier._meter.current == 2 * (100 + 200)
    assert torch.equal(tier.fetch(2), values[2])  # a read ahead gives its slot to a unit needed now
    assert torch.equal(tier.fetch(1), values[1])
    assert not tier.can_fetch(0)  # both slots feed gathers in flight: the stage finishes one first
    tier.done(2)
    assert tier.can_fetch(0) and torch.equal(tier.fetch(0), values[0])
    tier.done(0)
    tier.done(1)
    tier.discard()
    assert tier._meter.current == 0 and not tier.staging() and tier._meter.peak == 2 * (200 + 300)
    tier.close()


def test_disk_tier_needs_a_folder():
    layouts = [build_layout([("w", nn.Parameter(torch.zeros(3)))], 1, 0)]
    with pytest.raises(ConfigError, match="--offload-path"):
        ParamTier(layouts, torch.float32, "cpu", OffloadConfig(optimizer="cpu", params="disk", path="x"), None,
                  TransientMeter(), False)


def test_covers():
    assert _covers([(0, 5), (5, 9)], 9) and _covers([(3, 9), (0, 4)], 9) and _covers([], 0)
    assert not _covers([(0, 5), (6, 9)], 9) and not _covers([(1, 9)], 9)


def _cuda_tier(kind, path):
    """On the GPU, with the compute stream busy: shards reach the device only after the point where their
    destination was allocated, and a write waits for the copies still reading the old values."""
    numels = (1 << 20, 3000)
    layouts = [build_layout([(f"p{i}", nn.Parameter(torch.zeros(n)))], 1, 0) for i, n in enumerate(numels)]
    offload = OffloadConfig(optimizer="cpu", params=kind, path=path)
    old = [torch.randn(n).to(torch.bfloat16) for n in numels]
    new = [v + 1 for v in old]
    for staging in (True, False):
        tier = ParamTier(layouts, torch.bfloat16, "cuda", offload, os.path.join(path, str(staging)),
                         TransientMeter(), staging)
        for u, v in enumerate(old):
            tier.write(u, 0, v)
        tier.flush()
        hosts = tier.host if kind == "cpu" else [slot.host for slot in tier._slots]
        assert all(t.is_pinned() for t in hosts)
        got = []
        for u, n in enumerate(numels):
            torch.cuda._sleep(100_000_000)  # the copy must wait for this, and the write below for the copy
            if staging:
                tier.read_ahead(u)
                got.append(tier.fetch(u).clone())
            else:
                full = torch.empty(n, dtype=torch.bfloat16, device="cuda")
                tier.fetch(u, into=full).wait()
                got.append(full)
            tier.done(u)
            tier.write(u, 0, new[u])
        tier.flush()
        assert all(torch.equal(g.cpu(), v) for g, v in zip(got, old)), staging
        assert tier.traffic().host_to_device == 2 * sum(numels)
        tier.close()
    return True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_cuda_tier_copies_respect_the_compute_stream(kind, tmp_path):
    assert _world_of_one(_cuda_tier, kind, str(tmp_path))
