import math

import pytest

from mpzero.errors import ConfigError
from mpzero.training.lr_schedule import LRSchedule


def test_warmup_then_cosine_matches_closed_form():
    s = LRSchedule(max_lr=1e-3, min_lr=1e-5, warmup_iters=10, decay_iters=110, decay_style="cosine")
    for step in range(0, 130):
        if step <= 10:
            expected = 1e-3 * step / 10
        elif step > 110:
            expected = 1e-5
        else:
            expected = 1e-5 + (1e-3 - 1e-5) * 0.5 * (1 + math.cos(math.pi * (step - 10) / 100))
        assert s.lr(step) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert s.lr(60) == pytest.approx((1e-3 + 1e-5) / 2)


def test_linear_and_constant():
    linear = LRSchedule(max_lr=1.0, min_lr=0.0, warmup_iters=0, decay_iters=4, decay_style="linear")
    assert [linear.lr(i) for i in range(6)] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    constant = LRSchedule(max_lr=2.0, min_lr=0.0, warmup_iters=2, decay_iters=4, decay_style="constant")
    assert [constant.lr(i) for i in range(6)] == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0]


def test_unknown_style_is_one_line_error():
    with pytest.raises(ConfigError, match="--lr-decay-style 'step' is unknown"):
        LRSchedule(max_lr=1.0, min_lr=0.0, warmup_iters=0, decay_iters=4, decay_style="step")
