"""The one owner of the fp32 master weights and optimizer states of this rank's ZeRO partition, and the one
writer of the model's parameter slices.

A `MasterStore` receives, per bucket, this rank's parameter slice (in the model's dtype, owned by the stage)
and its fp32 starting values. It keeps the masters and the update rule's states (`mpzero.optim`: AdamW's two
moments, SGD's momentum buffer), runs the rule over them, and writes the updated
values into the parameter slices: during the step (the fused kernel writes the bf16/fp16 copy in the same
pass) or after new values were loaded (`publish`). The stage then spreads the slices (all-gather, release).
Where the masters live is the store's business alone: `DeviceMasters` keeps them beside the parameters; an
offload tier (host memory, disk) is another `MasterStore`, with no change to the stages or the front.

Each bucket's slice is split into at most two runs (weight-decayed, not decayed; see `FlatLayout.decay_runs`),
each updated in one call of the rule's step (AdamW: the fused `adamw_step`). The update is elementwise, so
with `impl="torch"` (torch.optim's single-tensor arithmetic) stages 1-3 match a single-process torch.optim.AdamW
or SGD bit for bit when the gradients do. States are created eagerly, so the memory line counts them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from mpzero.fused import pick_row
from mpzero.zero.tiers import OffloadHolder
from mpzero.zero.config import OptimizerConfig
from mpzero.zero.flat import FlatLayout
from mpzero.zero.norm import scale_grads_
from mpzero.zero.step_grads import Fp32Buckets


@dataclass(frozen=True)
class OwnedPiece:
    """A run of one parameter's elements that this rank's optimizer state holds: elements [start, end) of the
    parameter's flattened (TP-local) tensor, and 1-D views of the fp32 master and the rule's states over them.
    Writing through the views writes the optimizer state itself."""
    name: str
    shape: torch.Size
    start: int
    end: int
    tensors: dict[str, torch.Tensor]


class MasterStore(OffloadHolder, ABC):
    """What the optimizer front needs from wherever the fp32 state of this rank's partition lives."""

    step_count: int  # optimizer steps taken (the same on every rank: every rank steps, padding-only ones too)

    @property
    @abstractmethod
    def master_bytes_per_param(self) -> int:
        """Bytes per parameter the masters add to the parameters themselves (0 when they are the parameters)."""

    @abstractmethod
    def step(self, grads: list[torch.Tensor], lr: float, grad_scale: float = 1.0) -> None:
        """The update rule over the masters with this rank's fp32 gradient slices (per bucket; unscaled, averaged)
        times `grad_scale` (the clipping coefficient, `norm.clip_coefficient`), then the parameter slices hold the
        new values. A store whose rule cannot fold the scale into its pass scales the gradients first
        (`norm.scale_grads_`)."""

    @abstractmethod
    def publish(self) -> None:
        """Write the masters into the parameter slices (after values were loaded through `owned_pieces`)."""

    @abstractmethod
    def masters(self) -> list[torch.Tensor]:
        """Per bucket, this rank's fp32 master slice (for export)."""

    @abstractmethod
    def owned_pieces(self) -> list[OwnedPiece]:
        """Every piece of state this rank owns, parameter by parameter, as writable views."""

    @abstractmethod
    def held_tensors(self) -> list[torch.Tensor]:
        """The tensors the store holds in device memory (for the memory report)."""


class DeviceMasters(MasterStore):
    """Masters and the rule's states in memory on the parameters' device. In fp32 the master IS the parameter slice
    (one copy, as the ZeRO formula counts it); in bf16/fp16 it is a separate fp32 tensor."""

    def __init__(self, layouts: list[FlatLayout], param_shards: list[torch.Tensor],
                 initial: list[torch.Tensor], config: OptimizerConfig):
        """initial: per bucket, the fp32 values of this rank's parameter slice (unrounded in mixed precision)."""
        self.config, self.rule, self.layouts, self._param_shards = config, config.rule, layouts, param_shards
        self._shares_params = all(p.dtype == torch.float32 for p in param_shards)
        self._masters = [p if self._shares_params else v.clone() for p, v in zip(param_shards, initial)]
        device = param_shards[0].device if param_shards else torch.device("cpu")
        self.impl = self.rule.resolve_impl(device, config.impl) if param_shards else "torch"
        self.step_count = 0
        self._runs = []  # (bucket, start, end, decay, {state: tensor}) in shard coordinates
        for bucket, (layout, master) in enumerate(zip(layouts, self._masters)):
            for start, end, decay in layout.decay_runs():
                states = {key: torch.zeros(end - start, dtype=torch.float32, device=master.device)
                          for key in self.rule.state_names}
                self._runs.append((bucket, start, end, decay, states))

    @property
    def master_bytes_per_param(self) -> int:
        return 0 if self._shares_params else 4

    def step(self, grads: list[torch.Tensor], lr: float, grad_scale: float | torch.Tensor = 1.0,
             skip: torch.Tensor | None = None) -> None:
        """Where the rule folds the scale into its pass (AdamW's Triton kernel) and the gradients are fp32 shards,
        the clipping costs no pass of its own over them (GPT-2 124M: ~1 GB of memory traffic a step).
        `grad_scale` as a 0-dim device tensor and `skip` (a device flag: a set one writes nothing) come from a step
        launched without a host synchronisation (`ZeroOptimizer.launch_step`; the rule `skips_on_device`)."""
        c = self.config
        self.step_count += 1
        on_device = isinstance(grad_scale, torch.Tensor)
        fold = ((on_device or grad_scale != 1.0) and not isinstance(grads, Fp32Buckets)
                and self.rule.folds_grad_scale(self.impl))
        if not fold:
            scale_grads_(grads, grad_scale)
        scaled = {"grad_scale": grad_scale} if fold else {}
        if skip is not None:
            scaled["skip"] = skip
        for bucket, start, end, decay, states in self._runs:
            copy = None if self._shares_params else self._param_shards[bucket][start:end]
            self.rule.step(self._masters[bucket][start:end], grads[bucket][start:end], states, lr=lr,
                           weight_decay=c.weight_decay if decay else 0.0, step=self.step_count, impl=self.impl,
                           model_copy=copy, **scaled)

    def step_skippable(self, grads: list[torch.Tensor], lrs: list[float], skipped: torch.Tensor,
                       grad_scale: torch.Tensor | None, skip: torch.Tensor) -> None:
        """fp16's launched step (device_scaler.py): `lrs[k]` is the learning rate if `k` of the steps launched since
        the host last knew were skipped, `skipped` that count on the device (the step count goes back by as many);
        the gradients times `grad_scale` (None: 1); nothing is written where `skip` is set. The rule
        `skips_with_device_scalars`."""
        c = self.config
        self.step_count += 1
        if grad_scale is not None:
            scale_grads_(grads, grad_scale)
        rows = {decay: pick_row([self.rule.masked_scalars(lr, c.weight_decay if decay else 0.0, self.step_count - k)
                                 for k, lr in enumerate(lrs)], skipped) for decay in (False, True)}
        for bucket, start, end, decay, states in self._runs:
            copy = None if self._shares_params else self._param_shards[bucket][start:end]
            self.rule.step_masked(self._masters[bucket][start:end], grads[bucket][start:end], states, rows[decay],
                                  copy, skip, self.impl)

    def publish(self) -> None:
        if not self._shares_params:
            for shard, master in zip(self._param_shards, self._masters):
                shard.copy_(master)

    def masters(self) -> list[torch.Tensor]:
        return list(self._masters)

    def owned_pieces(self) -> list[OwnedPiece]:
        pieces = []
        for bucket, (layout, master) in enumerate(zip(self.layouts, self._masters)):
            runs = [(s, e, m) for b, s, e, _, m in self._runs if b == bucket]
            for i, start, end in layout.owned_pieces():
                run_start, _, states = next(r for r in runs if r[0] <= start and end <= r[1])
                offset = layout.shard_start + start - layout.offsets[i]  # where the piece begins in the parameter
                tensors = {"master": master[start:end]}
                tensors.update({key: states[key][start - run_start:end - run_start] for key in self.rule.state_names})
                pieces.append(OwnedPiece(layout.names[i], layout.shapes[i], offset, offset + end - start, tensors))
        return pieces

    def held_tensors(self) -> list[torch.Tensor]:
        return self._masters + [t for *_, states in self._runs for t in states.values()]
