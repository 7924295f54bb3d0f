"""Megatron's learning-rate schedule: linear warmup from 0, then constant, linear or cosine decay to
`min_lr` over `decay_iters`, and `min_lr` after that.

lr(step) for step = number of optimizer steps already taken (0 for the first iteration):
  step <= warmup:          max_lr * step / warmup                    (only when warmup > 0)
  step >  decay_iters:     min_lr
  otherwise, r = (step - warmup) / (decay_iters - warmup):
    constant  max_lr
    linear    min_lr + (max_lr - min_lr) * (1 - r)
    cosine    min_lr + (max_lr - min_lr) * 0.5 * (1 + cos(pi r))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mpzero.errors import ConfigError

DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    max_lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int
    decay_style: str = "linear"

    def __post_init__(self):
        if self.decay_style not in DECAY_STYLES:
            raise ConfigError(f"--lr-decay-style {self.decay_style!r} is unknown: use one of {', '.join(DECAY_STYLES)}")
        if self.min_lr > self.max_lr:
            raise ConfigError(f"--min-lr {self.min_lr} is above --lr {self.max_lr}")
        if self.decay_style != "constant" and self.warmup_iters >= self.decay_iters > 0:
            raise ConfigError(f"warmup ({self.warmup_iters} iterations) must end before --lr-decay-iters "
                              f"{self.decay_iters}")

    def lr(self, step: int) -> float:
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return self.max_lr * step / self.warmup_iters
        if self.decay_style == "constant":
            return self.max_lr
        if step > self.decay_iters:
            return self.min_lr
        ratio = (step - self.warmup_iters) / (self.decay_iters - self.warmup_iters)
        if self.decay_style == "linear":
            coefficient = 1.0 - ratio
        else:
            coefficient = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coefficient * (self.max_lr - self.min_lr)

