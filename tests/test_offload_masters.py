"""The offloaded optimizer tiers (host memory, disk) against DeviceMasters, bit for bit; the canonical AdamW
decomposition that makes that possible; the host-buffer formula (swap files: tests/test_offload_swap.py)."""

import os

import pytest
import torch
from torch import nn

from mpzero.fused import adamw_step
from mpzero.zero.offload.masters import BLOCK, OffloadedMasters, buffer_bytes, canonical_windows
from mpzero.zero.tiers import TensorParamSink
from mpzero.zero.config import AdamConfig, OffloadConfig
from mpzero.zero.flat import bucket_layouts, initial_values, mark_weight_decay
from mpzero.zero.masters import DeviceMasters

HYPER = dict(beta1=0.9, beta2=0.999, eps=1e-8)


def _split_adamw(n, cuts, impl, canonical, steps=3):
    """(whole-tensor state, state updated piece by piece at `cuts`) after `steps` AdamW steps."""
    gen = torch.Generator().manual_seed(0)
    p0, grads = torch.randn(n, generator=gen), [torch.randn(n, generator=gen) for _ in range(steps)]
    whole = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    split = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    bounds = [0, *cuts, n]
    for t, g in enumerate(grads, 1):
        kw = dict(lr=1e-3 * t, weight_decay=0.1, step=t, impl=impl, **HYPER)
        adamw_step(whole[0], g, whole[1], whole[2], **kw)
        for lo, hi in zip(bounds, bounds[1:]):
            if not canonical:
                adamw_step(*(x[lo:hi] for x in (split[0], g, split[1], split[2])), **kw)
                continue
            for a, b in canonical_windows(0, n, lo, hi):
                keep = slice(max(a, lo), min(b, hi))
                inner = slice(keep.start - a, keep.stop - a)
                scratch = [torch.zeros(b - a) for _ in range(4)]  # p, g, m, v of the window
                for dst, src in zip(scratch, (split[0], g, split[1], split[2])):
                    dst[inner] = src[keep]
                adamw_step(*scratch, **kw)
                for dst, src in zip((split[0], split[1], split[2]), (scratch[0], scratch[2], scratch[3])):
                    dst[keep] = src[inner]
    return whole, split


CUTS = [3, 17, 1000, 1001, 5003]


def test_fused_cpu_adamw_depends_on_the_split():
    """The lead's finding, reproduced: torch's fused CPU AdamW rounds a call's scalar tail differently."""
    whole, split = _split_adamw(10007, CUTS, "torch_fused", canonical=False)
    assert not all(torch.equal(x, y) for x, y in zip(whole, split))


@pytest.mark.parametrize("impl", ["torch_fused", "torch"])
@pytest.mark.parametrize("n,cuts", [(10007, CUTS), (10007, [1, 255, 256, 257, 511, 9984, 9985, 10006]),
                                    (300, [7, 14, 21, 299]), (256 * 5, [256, 300, 1024])])
def test_canonical_windows_are_bitwise_split_invariant(impl, n, cuts):
    whole, split = _split_adamw(n, cuts, impl, canonical=True)
    for x, y in zip(whole, split):
        assert torch.equal(x, y)


def test_canonical_windows_shape_and_cost():
    assert canonical_windows(0, 10007, 0, 10007) == [(0, 9984), (9984, 10007)]  # whole blocks, then the tail
    assert canonical_windows(5, 1005, 100, 1005) == [(5, 261), (261, 773), (773, 1005)]
    assert canonical_windows(0, 1000, 10, 20) == [(0, 256)]  # one cut block: scratch
    assert canonical_windows(0, 1000, 768, 1000) == [(768, 1000)]  # the partial last block, whole: in place
    # every element exactly once; scratch (windows not inside the piece) < 2 blocks per boundary
    n = 10007
    for cuts in (CUTS, list(range(7, n, 7)), list(range(1000, n, 1000))):
        bounds, scratch, seen = [0, *cuts, n], 0, torch.zeros(n, dtype=torch.int64)
        for lo, hi in zip(bounds, bounds[1:]):
            for a, b in canonical_windows(0, n, lo, hi):
                seen[max(a, lo):min(b, hi)] += 1
                if a < lo or b > hi:
                    scratch += b - a
        assert bool((seen == 1).all())
        assert scratch <= 2 * BLOCK * len(cuts)


# ------------------------------------------------------------------------ the store against DeviceMasters
SHAPES = {"w1": (37, 29), "b1": (29,), "w2": (300, 7), "ln": (301,), "emb": (11, 13), "b2": (1,)}


def _params(shapes):
    gen = torch.Generator().manual_seed(1)
    named = [(name, nn.Parameter(torch.randn(*shape, generator=gen))) for name, shape in shapes.items()]
    mark_weight_decay(named)  # Megatron's rule: the matrices decay, the vectors do not
    return named


def _stores(tmp_path, dtype, tier, sub_group, parts, impl="torch_fused", io="auto", shapes=SHAPES,
            bucket_numel=1500, buffer_count=3):
    layouts = bucket_layouts(_params(shapes), bucket_numel, parts, parts - 1)
    initial = [initial_values(l, torch.device("cpu"))[l.shard_start:l.shard_start + l.shard_numel] for l in layouts]
    adam = AdamConfig(weight_decay=0.1, impl=impl)
    device = DeviceMasters(layouts, [v.to(dtype, copy=True) for v in initial], [v.clone() for v in initial], adam)
    sink = TensorParamSink([v.to(dtype, copy=True) for v in initial])
    offload = OffloadConfig(optimizer=tier, path=str(tmp_path) if tier == "disk" else None,
                            sub_group_numel=sub_group, buffer_count=buffer_count, io=io)
    store = OffloadedMasters(layouts, sink, [v.clone() for v in initial], adam, offload,
                             str(tmp_path / "rank00000") if tier == "disk" else None, torch.device("cpu"))
    return layouts, device, store, sink


def _assert_same(device, store, sink):
    for ours, theirs in zip(sink.shards, device._param_shards):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(store.masters(), device.masters()):
        assert torch.equal(ours, theirs)
    pieces, expected = store.owned_pieces(), device.owned_pieces()
    assert [(p.name, p.start, p.end) for p in pieces] == [(p.name, p.start, p.end) for p in expected]
    for ours, theirs in zip(pieces, expected):
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(ours.tensors[key], theirs.tensors[key]), key


def _train_both(layouts, device, store, steps=10, seed=3):
    gen = torch.Generator().manual_seed(seed)
    for t in range(steps):
        grads = []
        for layout in layouts:
            g = torch.randn(layout.shard_numel, generator=gen)
            valid = max(0, min(layout.shard_numel, layout.numel - layout.shard_start))
            g[valid:] = 0  # padding has no gradient
            grads.append(g)
        lr = 1e-3 * (1 + 0.3 * t)
        device.step([g.clone() for g in grads], lr)
        store.step([g.clone() for g in grads], lr)


CASES = [  # (tier, sub_group, io, impl)
    ("cpu", 7, "auto", "torch_fused"), ("cpu", 1003, "auto", "torch_fused"), ("cpu", 10 ** 6, "auto", "torch_fused"),
    ("disk", 7, "auto", "torch_fused"), ("disk", 1003, "buffered", "torch_fused"),
    ("disk", 10 ** 6, "auto", "torch_fused"), ("disk", 1024, "auto", "torch_fused"),
    ("disk", 1024, "direct", "torch_fused"), ("disk", 1003, "auto", "torch"), ("cpu", 1003, "auto", "torch"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("tier,sub_group,io,impl", CASES)
def test_offloaded_masters_equal_device_masters(tmp_path, dtype, parts, tier, sub_group, io, impl):
    layouts, device, store, sink = _stores(tmp_path, dtype, tier, sub_group, parts, impl, io)
    try:
        assert len(layouts) > 1 and store.numel > sub_group or sub_group == 10 ** 6
        if tier == "disk":
            direct = io != "buffered" and (sub_group % 1024 == 0 or sub_group >= store.numel)
            assert store.io_mode == ("direct" if direct else "buffered")
        _train_both(layouts, device, store)
        _assert_same(device, store, sink)
        assert store.master_bytes_per_param == 4 and store.held_tensors() == []
    finally:
        store.close()


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_sub_group_of_one_element(tmp_path, tier):
    shapes = {"w": (20, 16), "b": (17,), "v": (9, 3)}
    layouts, device, store, sink = _stores(tmp_path, torch.bfloat16, tier, 1, 2, shapes=shapes, bucket_numel=200)
    try:
        _train_both(layouts, device, store, steps=4)
        _assert_same(device, store, sink)
    finally:
        store.close()


@pytest.mark.parametrize("impl", ["torch_fused", "torch"])
def test_long_runs_with_two_threads(tmp_path, impl):
    """Runs longer than torch's parallel grain (32768), split by sub-groups, with 2 intra-op threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        layouts, device, store, sink = _stores(tmp_path, torch.float32, "cpu", 10007, 1, impl,
                                               shapes={"w": (301, 233), "b": (40001,)}, bucket_numel=10 ** 6)
        _train_both(layouts, device, store, steps=3)
        _assert_same(device, store, sink)
        store.close()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("tier", ["cpu", "disk"])
@pytest.mark.parametrize("io", ["buffered", "direct"])
def test_publish_sees_values_written_through_owned_pieces(tmp_path, tier, io):
    """A checkpoint load writes through owned_pieces() (disk: the file maps), then publish(); training goes on
    exactly as DeviceMasters loaded the same way."""
    if tier == "cpu" and io == "direct":
        pytest.skip("io applies to the disk tier")
    layouts, device, store, sink = _stores(tmp_path, torch.bfloat16, tier, 1024, 2, io=io)
    try:
        _train_both(layouts, device, store, steps=2)
        gen = torch.Generator().manual_seed(9)
        for ours, theirs in zip(store.owned_pieces(), device.owned_pieces()):
            for key, tensor in ours.tensors.items():
                values = torch.randn(tensor.numel(), generator=gen).abs_() if key == "exp_avg_sq" else \
                    torch.randn(tensor.numel(), generator=gen)
                tensor.copy_(values)
                theirs.tensors[key].copy_(values)
        store.publish()
        device.publish()
        _assert_same(device, store, sink)
        _train_both(layouts, device, store, steps=3, seed=5)
        _assert_same(device, store, sink)
    finally:
        store.close()


# ------------------------------------------------------------------------ memory and byte counts
@pytest.mark.parametrize("tier", ["cpu", "disk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sub_group", [7, 1003, 2048, 10 ** 6])
def test_host_buffers_equal_the_formula(tmp_path, tier, dtype, sub_group):
    layouts, device, store, sink = _stores(tmp_path, dtype, tier, sub_group, 2, buffer_count=4)
    try:
        held = store.tier_bytes()
        expected = buffer_bytes(store.offload, store.numel, cuda=False, param_bytes=dtype.itemsize, rule=store.rule)
        assert held.host_buffers == expected == store.host_buffer_formula()[0]
        group = -(-min(sub_group, store.numel) // 1024) * 1024
        state = 4 * 3 * store.numel
        if tier == "cpu":
            assert held == type(held)(host=state, host_buffers=expected, disk=0)
            assert expected == (group * dtype.itemsize + 4095) // 4096 * 4096 + 4096 + 4096
        else:
            assert held.host == 0 and held.disk == 3 * -(-4 * store.numel // 4096) * 4096
            assert expected == 4 * 3 * (4 * group + 4096) + (group * dtype.itemsize + 4095) // 4096 * 4096 + 8192
    finally:
        store.close()


def test_disk_tier_host_memory_does_not_grow_with_the_model(tmp_path):
    small = _stores(tmp_path / "a", torch.float32, "disk", 1024, 1, shapes={"w": (40, 100)})[2]
    large = _stores(tmp_path / "b", torch.float32, "disk", 1024, 1, shapes={"w": (400, 100)})[2]
    try:
        assert large.numel == 10 * small.numel
        assert small.tier_bytes().host_buffers == large.tier_bytes().host_buffers
        assert len(large._pipe.buffers) == 3  # buffer_count, never more
    finally:
        small.close()
        large.close()


def test_transfers_count_file_bytes(tmp_path):
    layouts, device, store, sink = _stores(tmp_path, torch.float32, "disk", 1024, 1, io="buffered")
    try:
        before = store.transfers()
        assert before.disk_written == 4 * store.numel  # the masters, written at construction
        _train_both(layouts, device, store, steps=2)
        moved = store.transfers() - before
        assert moved.disk_read == moved.disk_written == 2 * 3 * 4 * store.numel
        assert moved.device_to_host == moved.host_to_device == 0  # a CPU run: nothing crosses a device
    finally:
        store.close()
    assert not os.path.exists(tmp_path / "rank00000")  # close() removes the scratch files and their folder
