"""The contract every ZeRO stage implements: what the optimizer front (optimizer.py) may ask of a stage.

A stage owns the model's parameter storage and the gradient buffers of this rank, laid out in flat buckets
(`layouts`, one `FlatLayout` per bucket or stage-3 unit). The front never reaches inside; it uses:

- `param_shards[b]`: this rank's slice of bucket b's parameters, in the model's dtype. The master store
  (masters.py) writes new values into these and nothing else; `after_update()` then makes the model see
  them (all-gather into the full buffers for stages 1-2, release of the gathered units for stage 3).
- `initial_master_slices()`: the fp32 starting values of those slices (unrounded in mixed precision), made one
  bucket at a time as the master store reads them, in order, at construction (construction.py: the stage makes
  each bucket's parameters then); the stage keeps no reference to them.
- `grad_shards[b]`: this rank's reduced (DP-averaged) gradient slice, aligned with `param_shards[b]`, valid
  after `end_backward()` of the last micro-batch; `zero_grad()` clears them. With the optimizer on disk
  (stages 2-3) there are none: `gradient_file` holds them (offload/grad_file.py), and each bucket's final slice
  is handed to the function given to `watch_final_gradients` as it is written there.
- `begin_backward(last_micro_batch)` / `end_backward()` bracket one micro-batch's backward: gradients are
  collected (and reduced when the stage reduces every micro-batch, or at the last one) in between.
- `held_tensors()`: the parameter and gradient storage this stage holds between steps, and `meter`, the
  transient buffers (gathered units, full gradient buckets) counted as they come and go, for the memory
  report; `peak_working_set()`: the formula those transient buffers follow, where the stage states one.
- `param_sink()`: where the master store writes updated parameter values (default: into `param_shards`);
  `tier_bytes()` / `transfers()`: state held off the device and bytes moved between tiers (stage 3's
  offloaded parameters; zero otherwise).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from mpzero.zero.tiers import OffloadHolder, ParamSink, TensorParamSink
from mpzero.zero.construction import ConstructionMeters
from mpzero.zero.flat import FlatLayout
from mpzero.zero.meter import TransientMeter

if TYPE_CHECKING:
    from mpzero.zero.grads import ReplicatedGrads, ShardedGrads


class ZeroStage(OffloadHolder, ABC):
    number: int  # the ZeRO stage, 0-3
    device: torch.device  # where the model computes
    layouts: list[FlatLayout]
    param_shards: list[torch.Tensor]
    grads: ReplicatedGrads | ShardedGrads  # this rank's gradient buffers (grads.py), an OffloadHolder of their own

    meter: TransientMeter
    construction: ConstructionMeters  # working bytes while the stage makes its buckets (construction.py)
    gathers: bool = False  # stage 3: units are gathered into full buffers made at construction

    @property
    @abstractmethod
    def grad_shards(self) -> list[torch.Tensor]: ...

    @abstractmethod
    def initial_master_slices(self) -> Sequence[torch.Tensor]: ...

    @abstractmethod
    def begin_backward(self, last_micro_batch: bool) -> None: ...

    @abstractmethod
    def end_backward(self) -> None: ...

    @abstractmethod
    def zero_grad(self) -> None: ...

    @abstractmethod
    def after_update(self) -> None: ...

    @abstractmethod
    def held_tensors(self) -> list[torch.Tensor]: ...

    @property
    def gradient_file(self):
        """A GradFile: this rank's gradient slices on disk (stages 2-3, optimizer on disk); None elsewhere."""
        return self.grads.file

    def watch_final_gradients(self, fn) -> None:
        """fn(bucket, values) for each bucket's final gradient slice as it goes to `gradient_file`."""
        if self.grads.file is None:
            raise NotImplementedError(f"stage {self.number} keeps its gradients where the step reads them")
        self.grads.on_final = fn

    def write_gradients_together(self, params: set) -> None:
        """`params`' gradients arrive together (a compiled backward): a stage whose collector can batch their writes
        does (collector.py, `GradCollector.write_together`); others ignore it."""

    def peak_working_set(self, p: int, g: int) -> tuple[int, str] | None:
        """(bytes, formula) the schedule holds beyond `held_tensors` at its in-step peak, for stages whose
        transient buffers follow a stated formula (stage 3); None: no peak is reported."""
        return None

    def regathered_numel(self) -> int:
        """Elements gathered per micro-batch beyond the stage's usual gathers (`comm_theory`'s `regathered`)."""
        return 0

    def param_sink(self) -> ParamSink:
        return TensorParamSink(self.param_shards)
