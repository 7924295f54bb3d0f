"""Loss scaling for fp16 in Megatron-LM's semantics (`megatron/core/optimizer/grad_scaler.py`).

The loss is multiplied by `scale` before backward and the gradients divided by it before the step.
Dynamic scaling: an overflow (inf/nan in any rank's gradients) skips the step and uses up one unit of
hysteresis; when hysteresis is exhausted the scale halves (never below the minimum). After
`window` consecutive clean steps the scale doubles and hysteresis is restored.
"""

from __future__ import annotations

from mpzero.zero.config import PrecisionConfig


class ConstantLossScaler:
    """fp32/bf16 (scale 1) or a static fp16 `--loss-scale`: never changes; overflowed steps are still skipped,
    and at a static scale every one of them is a skip at the lowest scale there is."""

    def __init__(self, scale: float = 1.0):
        self.scale = float(scale)
        self.skips_at_min_scale = 0

    def update(self, found_inf: bool) -> None:
        self.skips_at_min_scale = self.skips_at_min_scale + 1 if found_inf else 0

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        pass  # the scale is the run's own: 1 for bf16/fp32, the flag's for a static --loss-scale (as Megatron)


class DynamicLossScaler:
    def __init__(self, initial_scale: float, min_scale: float, window: int, hysteresis: int):
        self.scale = float(initial_scale)
        self.min_scale, self.window, self.hysteresis = float(min_scale), window, hysteresis
        self._growth_tracker = 0  # clean steps since the last overflow or growth
        self._hysteresis_tracker = hysteresis  # overflows left before backing off
        self.skips_at_min_scale = 0  # consecutive overflows with nothing left to back off (DeepSpeed's signal)

    def update(self, found_inf: bool) -> None:
        self.skips_at_min_scale = self.skips_at_min_scale + 1 if found_inf and self.scale <= self.min_scale else 0
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * 0.5, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.window:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        """A dynamic scaler's state resumes; another kind's (a bf16/fp32 or static-scale checkpoint resumed
        with dynamic fp16) leaves this fresh scaler as it is."""
        if not {"growth_tracker", "hysteresis_tracker"} <= state.keys():
            return
        self.scale = float(state["scale"])
        self._growth_tracker = state["growth_tracker"]
        self._hysteresis_tracker = state["hysteresis_tracker"]


def make_loss_scaler(precision: PrecisionConfig):
    if precision.dtype != "fp16":
        return ConstantLossScaler(1.0)
    if precision.loss_scale is not None:
        return ConstantLossScaler(precision.loss_scale)
    return DynamicLossScaler(precision.initial_loss_scale, precision.min_loss_scale,
                             precision.loss_scale_window, precision.hysteresis)
