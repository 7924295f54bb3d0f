"""One flat layout family per reduction group: a model whose parameters are reduced and partitioned over different
groups (a mixture of experts: dense parameters over DP x CP, expert parameters over the expert-data-parallel group,
Megatron's `expt_dp`; S6 of the project's seams) gets one ZeRO stage per group, and `StageFamilies` presents them
to the optimizer front as one stage.

    families = parameter_families(named, groups)       # [Family("dense", dp_cp, ...), Family("expert", ...)]
    stage = StageFamilies([make(f) for f in families])  # buckets of the first family first, then the next

Each family's stage is an ordinary `Stage0`..`Stage3` over its own group, so a bucket (or a stage-3 unit) never
mixes groups: its reduce-scatter, its all-gather and its partition are its group's. The family's gradients are
divided by the data-parallel size whatever its group (grads.py): every family ends averaged over the same tokens.
The families share the transient and construction meters, so the memory line's peaks are the model's. Bucket b of
the whole is bucket b - offset of the family holding it (`locate`); the front's lists (`layouts`, `param_shards`,
`grad_shards`) are the families' concatenated, so the master store, the norm and checkpoints work on them as on
one stage's.

A model without expert parameters has one family, and the optimizer uses its stage as it is: the path of every
run before families existed, unchanged. `make_stage` is the optimizer's one call: the stage, or the families'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mpzero.comm import CommGroup
from mpzero.deferred_init import is_deferred
from mpzero.errors import ConfigError
from mpzero.parallel import ParallelGroups
from mpzero.tensor_parallel import is_expert
from mpzero.zero.config import OffloadConfig, PrecisionConfig, ZeroConfig
from mpzero.zero.construction import ConstructionMeters, InitialSlices, WorkingSet, construction_working_set
from mpzero.zero.meter import TransientMeter
from mpzero.zero.stage3 import Stage3, expert_units
from mpzero.zero.stage_base import ZeroStage
from mpzero.zero.stages import Stage0, Stage1, Stage2
from mpzero.zero.tiers import ParamSink, TierBytes, Transfers


@dataclass(frozen=True)
class Family:
    """The parameters reduced over one group: `group` partitions them (ZeRO), `tp` is the group across which a
    replicated one is identical (the norm counts it on its rank 0), `divisor` what their summed gradients are
    divided by."""
    name: str  # "dense" or "expert"
    named_params: list
    group: CommGroup
    tp: CommGroup
    divisor: int

    @property
    def numel(self) -> int:
        return sum(param.numel() for _, param in self.named_params)


def parameter_families(named_params: list[tuple[str, nn.Parameter]], groups: ParallelGroups) -> list[Family]:
    """The dense family (over `groups.dp`, ZeRO's DP x CP group) and, where the model has expert parameters
    (`tensor_parallel.is_expert`), the expert family (over `groups.expert_dp`, their TP group `expert_tp`), each
    divided by the DP x CP size."""
    dense = [(n, p) for n, p in named_params if not is_expert(p)]
    experts = [(n, p) for n, p in named_params if is_expert(p)]
    families = [Family("dense", dense, groups.dp, groups.tp, groups.dp.size)] if dense else []
    if experts:
        families.append(Family("expert", experts, groups.expert_dp, groups.expert_tp, groups.dp.size))
    return families


class _Sinks(ParamSink):
    """The families' parameter sinks, addressed by the whole's bucket."""

    def __init__(self, stages: "StageFamilies"):
        self._stages, self._sinks = stages, [stage.param_sink() for stage in stages.stages]
        self.dtype, self.device = self._sinks[0].dtype, self._sinks[0].device

    def write(self, bucket: int, start: int, values: torch.Tensor) -> None:
        family, local = self._stages.locate(bucket)
        self._sinks[family].write(local, start, values)

    def flush(self) -> None:
        for sink in self._sinks:
            sink.flush()

    def transfers(self) -> Transfers:
        total = Transfers()
        for sink in self._sinks:
            total = total + sink.transfers()
        return total


class StageFamilies(ZeroStage):
    """The families' stages as one `ZeroStage` (see the module docstring)."""

    def __init__(self, stages: list[ZeroStage]):
        self.stages = stages
        first = stages[0]
        self.number, self.device, self.meter, self.construction = (first.number, first.device, first.meter,
                                                                   first.construction)
        self.layouts = [layout for stage in stages for layout in stage.layouts]
        self.param_shards = [shard for stage in stages for shard in stage.param_shards]
        self.gathers = any(stage.gathers for stage in stages)
        self.offsets, at = [], 0
        for stage in stages:
            self.offsets.append(at)
            at += len(stage.layouts)

    def locate(self, bucket: int) -> tuple[int, int]:
        """(family, its bucket) of the whole's bucket."""
        family = max(f for f, offset in enumerate(self.offsets) if offset <= bucket)
        return family, bucket - self.offsets[family]

    @property
    def grad_shards(self) -> list[torch.Tensor]:
        return [shard for stage in self.stages for shard in stage.grad_shards]

    @property
    def gradient_file(self):
        return None  # a disk tier of gradients is refused with families (optimizer.py)

    def initial_master_slices(self) -> InitialSlices:
        """Each family's slices in turn; a family's working set is released (its `finish`) before the next
        family's first bucket is made."""
        parts = [stage.initial_master_slices() for stage in self.stages]
        current = {"family": 0}

        def make(bucket: int):
            family, local = self.locate(bucket)
            while current["family"] < family:
                parts[current["family"]].finish()
                current["family"] += 1
            return parts[family][local], self.construction.device, 0

        def done() -> None:
            for part in parts[current["family"]:]:
                part.finish()

        return InitialSlices(len(self.layouts), make, done=done)

    def begin_backward(self, last_micro_batch: bool) -> None:
        for stage in self.stages:
            stage.begin_backward(last_micro_batch)

    def end_backward(self) -> None:
        for stage in self.stages:
            stage.end_backward()

    def zero_grad(self) -> None:
        for stage in self.stages:
            stage.zero_grad()

    def after_update(self) -> None:
        for stage in self.stages:
            stage.after_update()

    def write_gradients_together(self, params: set) -> None:
        for stage in self.stages:
            stage.write_gradients_together(params)

    def held_tensors(self) -> list[torch.Tensor]:
        return [tensor for stage in self.stages for tensor in stage.held_tensors()]

    def peak_working_set(self, p: int, g: int) -> tuple[int, str] | None:
        """None: each family's schedule states its own working set, not the two interleaved."""
        return None

    def regathered_numel(self) -> int:
        return sum(stage.regathered_numel() for stage in self.stages)

    def param_sink(self) -> ParamSink:
        return _Sinks(self)

    def tier_bytes(self) -> TierBytes:
        return sum((stage.tier_bytes() for stage in self.stages), TierBytes())

    def transfers(self) -> Transfers:
        return sum((stage.transfers() for stage in self.stages), Transfers())

    def host_buffer_formula(self) -> tuple[int, str]:
        parts = [stage.host_buffer_formula() for stage in self.stages]
        return sum(b for b, _ in parts), "+".join(t for _, t in parts if t != "0") or "0"

    def check_files(self) -> None:
        for stage in self.stages:
            stage.check_files()

    def close(self) -> None:
        for stage in self.stages:
            stage.close()


def make_stage(model: nn.Module, named_params, groups: ParallelGroups, zero: ZeroConfig,
               precision: PrecisionConfig, units, offload: OffloadConfig, directory: str | None) -> ZeroStage:
    """The stage over `groups.dp`, or with expert parameters one stage per family (families.py)."""
    families = parameter_families(named_params, groups)
    if units is not None and zero.stage != 3:
        raise ConfigError(f"units are a ZeRO stage 3 setting, but --zero-stage is {zero.stage}: drop them")
    if len(families) == 1 and families[0].name == "dense":
        return _family_stage(model, families[0], zero, precision, units, offload, directory, groups)
    if offload.params == "disk" or offload.grads_tier(zero.stage) == "disk":
        raise ConfigError("expert parameters are partitioned apart from the dense ones, and the disk tier keeps one "
                          "file per rank for parameters and gradients: offload them to cpu, or keep "
                          "--offload-optimizer disk at --zero-stage 1")
    meters = (TransientMeter(), ConstructionMeters())
    stages = []
    for family in families:
        family_units = expert_units(model) if family.name == "expert" else units
        stages.append(_family_stage(model, family, zero, precision, family_units, offload, directory, groups, meters))
    return StageFamilies(stages)


def _family_stage(model, family: Family, zero: ZeroConfig, precision: PrecisionConfig, units, offload: OffloadConfig,
                  directory, groups: ParallelGroups, meters=None) -> ZeroStage:
    first = family.named_params[0][1]
    device = groups.device if is_deferred(first) else first.device  # a deferred model is made on the run's device
    divisor = None if family.divisor == family.group.size else family.divisor
    if zero.stage == 3:
        return Stage3(model, family.named_params, family.group, precision, zero, device, units, offload=offload,
                      directory=directory, divisor=divisor, meters=meters)
    return {0: Stage0, 1: Stage1, 2: Stage2}[zero.stage](family.named_params, family.group, precision, zero, device,
                                                         offload, directory, divisor=divisor, meters=meters)


def family_stages(stage: ZeroStage) -> list[ZeroStage]:
    """Each family's stage, in the families' order (`make_stage`'s stage: one per family, or the only family's)."""
    return stage.stages if isinstance(stage, StageFamilies) else [stage]


def families_by_bucket(stage: ZeroStage, families: list[Family]) -> list[Family]:
    """The family of each of the stage's buckets, in order."""
    return [family for family, one in zip(families, family_stages(stage)) for _ in one.layouts]


def families_working_set(layouts: list[list], gathers: list[bool], stage: int, p: int, mixed: bool,
                         params_offloaded: bool) -> WorkingSet:
    """`construction_working_set` of each family's layouts with its own gathering (a family over one rank makes no
    full unit buffer, whatever the other does), the largest device and host figures."""
    sets = [construction_working_set(list(family), stage, p, mixed, params_offloaded, gathering)
            for family, gathering in zip(layouts, gathers)]
    device = max(sets, key=lambda w: w.device)
    host = max(sets, key=lambda w: w.host)
    return WorkingSet(device.device, device.device_text, host.host, host.host_text)
