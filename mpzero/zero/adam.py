"""torch's AdamW over this rank's fp32 master slices.

Each bucket's master slice is split into at most two runs (weight-decayed, not decayed; see
`FlatLayout.decay_runs`), and each run is one tensor handed to `torch.optim.AdamW`. The for-loop
implementation (foreach=False) is elementwise, so updating a flat slice is the same arithmetic as
updating each parameter on its own: stages 1-3 match a single-process AdamW bit for bit when the
gradients do. (With a few large flat tensors the loop costs nothing over foreach.)
Adam's moments are created eagerly, so the memory line printed at start counts them.
"""

from __future__ import annotations

import torch

from mpzero.zero.config import AdamConfig
from mpzero.zero.flat import FlatLayout


class MasterAdam:
    def __init__(self, layouts: list[FlatLayout], masters: list[torch.Tensor], adam: AdamConfig):
        self.runs = []  # (bucket, start, end, master view) in shard coordinates
        groups = {True: [], False: []}
        for bucket, (layout, master) in enumerate(zip(layouts, masters)):
            for start, end, decay in layout.decay_runs():
                view = master[start:end]
                self.runs.append((bucket, start, end, view))
                groups[decay].append(view)
        param_groups = [{"params": groups[True], "weight_decay": adam.weight_decay},
                        {"params": groups[False], "weight_decay": 0.0}]
        param_groups = [g for g in param_groups if g["params"]]
        # A rank whose slices hold only padding (tiny model, many ranks) has nothing to update.
        self.optimizer = None if not param_groups else torch.optim.AdamW(
            param_groups, lr=adam.lr, betas=(adam.beta1, adam.beta2), eps=adam.eps, foreach=False)
        for *_, view in self.runs:
            self.optimizer.state[view] = {"step": torch.tensor(0.0, dtype=torch.float32),
                                          "exp_avg": torch.zeros_like(view),
                                          "exp_avg_sq": torch.zeros_like(view)}

    def step(self, grads: list[torch.Tensor], lr: float) -> None:
        """grads: per bucket, this rank's fp32 gradient slice (unscaled, averaged, clipped)."""
        if self.optimizer is None:
            return
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for bucket, start, end, view in self.runs:
            view.grad = grads[bucket][start:end]
        self.optimizer.step()
        for *_, view in self.runs:
            view.grad = None

    def state_tensors(self) -> list[torch.Tensor]:
        if self.optimizer is None:
            return []
        return [t for state in self.optimizer.state.values() for t in state.values()]

    def moments(self, view: torch.Tensor) -> dict:
        return self.optimizer.state[view]
