"""The mixed-precision step's bounded fp32 working set (issue 24, item 2): low-precision gradient shards cast,
unscaled and clipped a sub-group at a time by an offloaded optimizer give bit for bit the masters, moments and
parameters of the in-memory step (which casts whole buckets), and the fp32 bytes alive at once, counted by
`Fp32Buckets.meter`, stay within `step_fp32_bytes`: one sub-group plus one in flight (4 x 2G), not 4P/N."""

import pytest
import torch

from mpzero.zero.accounting import step_fp32_bytes
from mpzero.zero.step_grads import Fp32Buckets
from tests.test_offload_masters import _assert_same, _stores

SCALE = 2.0 ** -7  # 1 / loss scale
CLIP = 0.43


def _low_precision_grads(layouts, dtype, gen):
    grads = []
    for layout in layouts:
        g = (torch.randn(layout.shard_numel, generator=gen) * 100).to(dtype)
        valid = max(0, min(layout.shard_numel, layout.numel - layout.shard_start))
        g[valid:] = 0  # padding has no gradient
        grads.append(g)
    return grads


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("tier,sub_group", [("cpu", 7), ("cpu", 1003), ("disk", 1024), ("cpu", 10 ** 6)])
def test_offloaded_step_casts_sub_groups_bitwise_the_in_memory_step(tmp_path, dtype, tier, sub_group):
    layouts, device, store, sink = _stores(tmp_path, dtype, tier, sub_group, 2)
    gen, peaks = torch.Generator().manual_seed(4), []
    try:
        for t in range(4):
            grads = _low_precision_grads(layouts, dtype, gen)
            lr = 1e-3 * (1 + 0.3 * t)
            ours, theirs = Fp32Buckets(grads, SCALE), Fp32Buckets([g.clone() for g in grads], SCALE)
            for buckets in (ours, theirs):
                buckets.clip_(CLIP)
            store.step(ours, lr)
            device.step(theirs, lr)
            peaks.append((ours.meter.peak, theirs.meter.peak))
            ours.release()
            assert ours.meter.current == 0
        _assert_same(device, store, sink)
    finally:
        store.close()
    largest = max(layout.shard_numel for layout in layouts)
    bound = step_fp32_bytes(offloaded=True, largest_shard=largest, sub_group_numel=sub_group)[0]
    assert bound == 4 * 2 * min(sub_group, largest)
    for offloaded, in_memory in peaks:
        assert 0 < offloaded <= bound, (offloaded, bound)
        assert in_memory == step_fp32_bytes(offloaded=False, largest_shard=largest, sub_group_numel=sub_group)[0]
        total = 4 * sum(layout.shard_numel for layout in layouts)
        assert offloaded < total or sub_group >= largest  # not 4P/N: the old keep_all held `total`
