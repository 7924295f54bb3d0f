"""fp16's loss scaler on the device (mpzero/zero/device_scaler.py) against the host's (scaler.py): the same scale,
growth and hysteresis trackers and stop signal, step for step, over overflows that back off, hysteresis that absorbs
them, growth after a clean window and the minimum scale; with no read of the device; and `settle` hands the state
and the skip count to the host."""

import random

import pytest
import torch

from mpzero.zero.device_scaler import DeviceLossScaler, scaled_loss
from mpzero.zero.scaler import ConstantLossScaler, DynamicLossScaler
from tests.host_syncs import counting


def _overflows(seed: int, n: int) -> list[bool]:
    rng = random.Random(seed)
    return [rng.random() < 0.4 for _ in range(n)]


def _host_state(scaler) -> list[float]:
    dynamic = isinstance(scaler, DynamicLossScaler)
    return [scaler.scale, scaler._growth_tracker if dynamic else 0, scaler._hysteresis_tracker if dynamic else 0,
            scaler.skips_at_min_scale]


@pytest.mark.parametrize("make", [lambda: DynamicLossScaler(2.0 ** 10, 2.0 ** 6, window=3, hysteresis=2),
                                  lambda: DynamicLossScaler(1000.0, 3.0, window=2, hysteresis=1),
                                  lambda: ConstantLossScaler(128.0)], ids=["megatron", "odd-minimum", "static"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_device_scaler_takes_the_host_scalers_decisions(make, seed):
    host, mirrored = make(), make()
    device = DeviceLossScaler(mirrored, torch.device("cpu"))
    longest, skipped = 0, 0
    for found_inf in _overflows(seed, 60):
        host.update(found_inf)
        with counting() as syncs:
            device.update(torch.tensor(found_inf))
        assert syncs.events == []
        longest, skipped = max(longest, host.skips_at_min_scale), skipped + found_inf
        assert [t.item() for t in device.state()[:4]] == _host_state(host)
        assert device.scale.dtype == torch.float64  # the host's Python double, not rounded
    assert device.settle([t.item() for t in device.state()]) == (skipped, longest)
    assert _host_state(mirrored) == _host_state(host)
    assert device.skipped.item() == 0 and device.longest_skips_at_min_scale.item() == host.skips_at_min_scale


def test_the_scaled_loss_is_the_floats_product():
    loss, scale = torch.tensor(5.123456, requires_grad=True), 2.0 ** 17 * 3
    device = DeviceLossScaler(DynamicLossScaler(scale, 1.0, 1000, 2), torch.device("cpu"))
    want = scaled_loss(loss, scale)
    got = scaled_loss(loss, device.loss_scale(torch.float32))
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert scaled_loss(loss, 1.0) is loss
    assert device.inverse().item() == 1.0 / scale
