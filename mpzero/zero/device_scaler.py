"""fp16's loss scaler kept on the device, for the step launched with no host synchronisation (issue 46).

`DynamicLossScaler` and `ConstantLossScaler` (scaler.py) decide on the host, so the synchronising step reads the
overflow flag every iteration. `DeviceLossScaler` holds the same state as 0-dim device tensors and makes the same
decisions with `torch.where`, from a device overflow flag (`found_inf`: the all-reduced squared gradient norm is
not finite, as Megatron's found_inf all-reduce over every rank that holds gradients), so nothing is read:
- the scale (fp64, as the host's Python double: halving and doubling are exact and `max(scale/2, min)` is the
  same value), the growth tracker, the hysteresis tracker: Megatron's DynamicGradScaler.update, branch for branch;
- a static `--loss-scale` keeps its scale and only counts overflows, as `ConstantLossScaler`;
- the run of consecutive overflows at the minimum scale (DeepSpeed's stop signal) and its longest run since the
  host last settled (`settle`), so a run that reached the limit between two reads is stopped at the next read;
- the skipped steps since the last settle: the launched update picks its learning rate and AdamW step count by
  it (a skipped iteration advances neither, as in the synchronising loop and in Megatron).
The host scaler mirrors the device one at each `settle` (a log line's read), so checkpoints save its state as ever.
torch.amp.GradScaler's `_amp_update_scale_` has no hysteresis, so it is not used here.
"""

from __future__ import annotations

import torch

from mpzero.zero.scaler import ConstantLossScaler, DynamicLossScaler


class DeviceLossScaler:
    """The state of `host` (a DynamicLossScaler or ConstantLossScaler) on `device`, updated there."""

    def __init__(self, host: DynamicLossScaler | ConstantLossScaler, device: torch.device):
        self.host, self.dynamic = host, isinstance(host, DynamicLossScaler)

        def full(value, dtype=torch.int64):
            return torch.full((), value, dtype=dtype, device=device)

        self.scale = full(host.scale, torch.float64)
        self.growth = full(host._growth_tracker if self.dynamic else 0)
        self.hysteresis = full(host._hysteresis_tracker if self.dynamic else 0)
        self.skips_at_min_scale = full(host.skips_at_min_scale)
        self.longest_skips_at_min_scale = self.skips_at_min_scale.clone()
        self.skipped = full(0)  # steps skipped since the last settle

    def loss_scale(self, dtype: torch.dtype) -> torch.Tensor:
        """The scale a loss of `dtype` is multiplied by: the host float as a kernel takes it (rounded to `dtype`)."""
        return self.scale.to(dtype)

    def inverse(self) -> torch.Tensor:
        """1 / scale in fp64, as the host's `1.0 / scale` (a kernel then rounds it to fp32 as it rounds the float)."""
        return torch.reciprocal(self.scale)

    def update(self, found_inf: torch.Tensor) -> None:
        """The host scaler's `update(found_inf)`, on the device (module docstring)."""
        at_min = found_inf & (self.scale <= self.host.min_scale) if self.dynamic else found_inf
        self.skips_at_min_scale.copy_(torch.where(at_min, self.skips_at_min_scale + 1, 0))
        torch.maximum(self.longest_skips_at_min_scale, self.skips_at_min_scale, out=self.longest_skips_at_min_scale)
        self.skipped.add_(found_inf.to(torch.int64))
        if not self.dynamic:
            return
        hysteresis = torch.where(found_inf, self.hysteresis - 1, self.hysteresis)
        growth = torch.where(found_inf, 0, self.growth + 1)
        backs_off = found_inf & (hysteresis <= 0)
        grows = ~found_inf & (growth == self.host.window)
        scale = torch.where(backs_off, torch.clamp_min(self.scale * 0.5, self.host.min_scale), self.scale)
        self.scale.copy_(torch.where(grows, scale * 2.0, scale))
        self.growth.copy_(torch.where(grows, 0, growth))
        self.hysteresis.copy_(torch.where(grows, self.host.hysteresis, hysteresis))

    def state(self) -> list[torch.Tensor]:
        """What `settle` takes from one read of the device, in its order."""
        return [self.scale, self.growth, self.hysteresis, self.skips_at_min_scale, self.longest_skips_at_min_scale,
                self.skipped]

    def settle(self, values: list[float]) -> tuple[int, int]:
        """The host scaler takes `values` (`state()` read to the host); the skip counter and the longest run restart.
        Returns (steps skipped since the last settle, the longest run of overflows at the minimum scale in them)."""
        scale, growth, hysteresis, at_min, longest, skipped = values
        self.host.skips_at_min_scale = int(at_min)
        if self.dynamic:
            self.host.scale, self.host._growth_tracker, self.host._hysteresis_tracker = scale, int(growth), \
                int(hysteresis)
        self.skipped.zero_()
        self.longest_skips_at_min_scale.copy_(self.skips_at_min_scale)
        return int(skipped), int(longest)


def scaled_loss(loss: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """`loss` times the loss scale `ZeroOptimizer.backward_window` yields (a float, or fp16's device scale as an
    fp32 tensor, not read: the same product as the float's for an fp32 loss)."""
    return loss * scale if isinstance(scale, torch.Tensor) or scale != 1.0 else loss
