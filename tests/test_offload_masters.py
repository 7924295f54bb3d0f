"""The offloaded optimizer tiers (host memory, disk) against DeviceMasters, bit for bit; the canonical AdamW
decomposition that makes that possible; the host-buffer formula; swap files and their one-line errors."""

import errno
import os

import pytest
import torch
from torch import nn

from mpzero.errors import ConfigError, TrainingError
from mpzero.fused import adamw_step
from mpzero.zero.offload.masters import BLOCK, OffloadedMasters, buffer_bytes, canonical_windows
from mpzero.zero.tiers import TensorParamSink
from mpzero.zero.offload.swap import SwapFile, aligned_empty, disk_error_message
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


# ------------------------------------------------------------------------ swap files
@pytest.mark.parametrize("io", ["buffered", "direct"])
def test_swap_file_unaligned_ranges(tmp_path, io):
    f = SwapFile(str(tmp_path / "swap.bin"), 10000, io)
    try:
        assert f.nbytes == 12288 and os.path.getsize(f.path) == 12288 and f.direct == (io == "direct")
        mirror = torch.zeros(f.nbytes, dtype=torch.uint8)
        gen = torch.Generator().manual_seed(0)
        for offset, n in [(0, 4096), (3, 5), (4000, 200), (100, 8000), (12287, 1), (4096, 4096)]:
            values = torch.randint(0, 255, (n,), dtype=torch.uint8, generator=gen)
            f.write(offset, values)
            mirror[offset:offset + n] = values
            out = torch.empty(n, dtype=torch.uint8)
            f.read(offset, out)
            assert torch.equal(out, values)
        whole = aligned_empty(f.nbytes, torch.uint8)
        assert whole.data_ptr() % 4096 == 0
        f.read(0, whole)
        assert torch.equal(whole, mirror)  # no write disturbed the bytes around it
        with pytest.raises(ValueError, match="outside"):
            f.write(12000, torch.zeros(1000, dtype=torch.uint8))
    finally:
        f.close(remove=True)


def _refuses_o_direct(directory):
    try:
        fd = os.open(os.path.join(directory, "mpzero-direct-probe"), os.O_RDWR | os.O_CREAT | os.O_DIRECT)
    except OSError as error:
        return error.errno == errno.EINVAL
    os.close(fd)
    os.remove(os.path.join(directory, "mpzero-direct-probe"))
    return False


def test_direct_io_refused_is_one_line():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm (tmpfs) here")
    if not _refuses_o_direct("/dev/shm"):
        pytest.skip("tmpfs accepts O_DIRECT on this kernel (Linux 6.6 and later): no file system here refuses it")
    path = f"/dev/shm/mpzero-test-{os.getpid()}.bin"
    with pytest.raises(ConfigError) as error:
        SwapFile(path, 4096, "direct")
    message = str(error.value)
    assert "\n" not in message and "--offload-io direct" in message and path in message
    assert "--offload-io buffered" in message
    f = SwapFile(path, 4096, "auto")
    assert not f.direct
    f.close(remove=True)


def test_disk_full_is_one_line(tmp_path, monkeypatch):
    """ENOSPC at preallocation (no honest way to fill a disk in a unit test: posix_fallocate is made to refuse)."""
    message = disk_error_message(str(tmp_path / "master.bin"), 123456, errno.ENOSPC, 5 << 20)
    assert "\n" not in message and str(tmp_path / "master.bin") in message and "120.6 KiB" in message
    assert "--offload-path" in message and "5.0 MiB free" in message and "ENOSPC" in message

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    for io in ("buffered", "auto"):
        with pytest.raises(ConfigError, match="needs 8.0 KiB") as error:
            SwapFile(str(tmp_path / "x.bin"), 5000, io)
        assert "\n" not in str(error.value) and "--offload-path" in str(error.value)
        assert not os.path.exists(tmp_path / "x.bin")  # the half-made file is removed


def test_disk_full_during_a_write_is_a_training_error(tmp_path, monkeypatch):
    f = SwapFile(str(tmp_path / "y.bin"), 4096, "buffered")

    def full(fd, buffers, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(TrainingError, match="--offload-path"):
        f.write(0, torch.zeros(16, dtype=torch.uint8))
    f.close(remove=True)
