"""AdamW over this rank's fp32 master slices, through the fused `adamw_step` (mpzero.fused).

Each bucket's master slice is split into at most two runs (weight-decayed, not decayed; see
`FlatLayout.decay_runs`); each run is one flat tensor updated in one pass, which also writes the
bf16/fp16 model copy when the parameters are in low precision. The update is elementwise, so with
`impl="torch"` (torch.optim.AdamW's single-tensor arithmetic) stages 1-3 match a single-process AdamW
bit for bit when the gradients do. Moments are created eagerly, so the memory line counts them.
"""

from __future__ import annotations

import torch

from mpzero.fused import adamw_step, resolve_impl
from mpzero.zero.config import AdamConfig
from mpzero.zero.flat import FlatLayout


class MasterAdam:
    def __init__(self, layouts: list[FlatLayout], masters: list[torch.Tensor], adam: AdamConfig):
        self.config = adam
        self.impl = resolve_impl("adamw_step", masters[0].device, adam.impl) if masters else "torch"
        self.runs = []  # (bucket, start, end, master view) in shard coordinates
        self._decay, self._state = [], {}
        for bucket, (layout, master) in enumerate(zip(layouts, masters)):
            for start, end, decay in layout.decay_runs():
                view = master[start:end]
                self.runs.append((bucket, start, end, view))
                self._decay.append(decay)
                self._state[view] = {"step": torch.tensor(0.0, dtype=torch.float32),
                                     "exp_avg": torch.zeros_like(view), "exp_avg_sq": torch.zeros_like(view)}

    def step(self, grads: list[torch.Tensor], lr: float, model_copies: list[torch.Tensor] | None = None) -> None:
        """grads: per bucket, this rank's fp32 gradient slice (unscaled, averaged, clipped);
        model_copies: per bucket, the low-precision parameter slice to refresh in the same pass."""
        c = self.config
        for (bucket, start, end, view), decay in zip(self.runs, self._decay):
            state = self._state[view]
            state["step"] += 1
            adamw_step(view, grads[bucket][start:end], state["exp_avg"], state["exp_avg_sq"], lr=lr,
                       beta1=c.beta1, beta2=c.beta2, eps=c.eps, weight_decay=c.weight_decay if decay else 0.0,
                       step=int(state["step"].item()), impl=self.impl,
                       model_copy=None if model_copies is None else model_copies[bucket][start:end])

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for state in self._state.values() for t in state.values()]

    def moments(self, view: torch.Tensor) -> dict:
        return self._state[view]
