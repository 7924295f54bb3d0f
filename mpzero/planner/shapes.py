"""The model's trainable parameters at a TP size, read from the real model built on meta tensors (no memory),
and the ZeRO layouts the code would build from them, through the code's own functions: the planner never
restates a parameter shape, a bucket boundary or a padding rule.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from mpzero.comm import CommGroup
from mpzero.models import family_of
from mpzero.planner.fake import engine_device, no_data
from mpzero.tensor_parallel import RNGStatesTracker, is_expert
from mpzero.zero import (FlatLayout, assign_params, bucket_layouts, build_layout, default_units, expert_units,
                         layer_units, mark_weight_decay, predicted_trace, recompute_chunks)


@dataclass(frozen=True, eq=False)
class ModelShapes:
    """One TP rank's model (meta tensors) and its trainable parameters in registration order. A mixture of experts
    has two families (zero/families.py): the dense parameters, partitioned over DP x CP, and the expert ones, over
    the expert-DP group; layouts list the dense family's first, then the expert family's, as the optimizer does."""
    config: object  # the family's config (`mpzero.models.family_of`)
    tp: int
    model: nn.Module
    named: tuple[tuple[str, nn.Parameter], ...]

    @property
    def dense(self) -> tuple[tuple[str, nn.Parameter], ...]:
        return tuple((n, p) for n, p in self.named if not is_expert(p))

    @property
    def experts(self) -> tuple[tuple[str, nn.Parameter], ...]:
        return tuple((n, p) for n, p in self.named if is_expert(p))

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.named)

    @property
    def largest_param(self) -> int:
        return max(p.numel() for _, p in self.named)

    def layer_numel(self) -> int:
        """Trainable elements of one transformer layer (of this TP rank)."""
        return sum(p.numel() for p in self.model.layers[0].parameters() if p.requires_grad)

    def layouts(self, stage: int, dp: int, dp_rank: int, bucket_numel: int, units: str = "layer",
                expert_dp: tuple[int, int] | None = None) -> tuple[FlatLayout, ...]:
        """Every family's layouts (`family_layouts`), the dense family's first."""
        return sum(self.family_layouts(stage, dp, dp_rank, bucket_numel, units, expert_dp), ())

    @functools.lru_cache(maxsize=None)
    def family_layouts(self, stage: int, dp: int, dp_rank: int, bucket_numel: int, units: str = "layer",
                       expert_dp: tuple[int, int] | None = None) -> tuple[tuple[FlatLayout, ...], ...]:
        """The flat layouts `ZeroOptimizer` builds for this model, per family (dense over `dp`, the experts over
        `expert_dp` (size, rank); None: the same group, as at EP 1): buckets (stages 0-2; replicated at stage 0) or
        the root and one unit per layer (or, `units` "linear", per linear layer; for the experts each expert stack)
        with trainable parameters (stage 3)."""
        out = []
        for family, (size, rank) in (("dense", (dp, dp_rank)), ("expert", expert_dp or (dp, dp_rank))):
            named = self.dense if family == "dense" else self.experts
            if not named:
                continue
            if stage == 3:
                assigned, kept = self._units(units, family)
                out.append(tuple(build_layout(assigned[u], size, rank) for u in kept))
            else:
                parts, part = (size, rank) if stage > 0 else (1, 0)
                out.append(tuple(bucket_layouts(list(named), bucket_numel, parts, part)))
        return tuple(out)

    def _modules(self, units: str, family: str) -> list[nn.Module]:
        return expert_units(self.model) if family == "expert" else default_units(self.model, units)

    @functools.lru_cache(maxsize=None)
    def _units(self, units: str, family: str = "dense") -> tuple[list, tuple[int, ...]]:
        """Stage3's rule: the parameters of [root, unit 1, ...] and the units kept (the root, then those that hold
        trainable parameters), of the family's parameters."""
        named = list(self.dense if family == "dense" else self.experts)
        assigned = assign_params(self.model, self._modules(units, family), named)
        return assigned, (0,) + tuple(u for u in range(1, len(assigned)) if assigned[u])

    @functools.lru_cache(maxsize=None)
    def stage3_trace(self, units: str = "layer", recomputed: tuple[tuple[int, ...], ...] = (),
                     family: str = "dense") -> tuple[tuple[int, str], ...]:
        """The demand trace `Stage3` records for this model (`schedule3.predicted_trace`): its layers' units, with
        the layers full recomputation replays together (`full_recompute_chunks`; the shapes' own config is
        normalized, without recomputation); `family` "expert": the expert stacks' units."""
        modules = self._modules(units, family)
        layers = layer_units(self.model, modules, list(self._units(units, family)[1][1:]))
        return tuple(predicted_trace(layers, [list(chunk) for chunk in recomputed]))


def full_recompute_chunks(config) -> tuple[tuple[int, ...], ...]:
    """The layers of `config` that full recomputation replays together (`schedule3.recompute_chunks`)."""
    chunks = recompute_chunks(config.num_layers, config.resolved_recompute_method,
                              config.resolved_recompute_num_layers)
    return tuple(tuple(chunk) for chunk in chunks)


@functools.lru_cache(maxsize=64)
def model_shapes(config, tp: int, stage=None, ep: int = 1, etp: int | None = None) -> ModelShapes:
    """The model of `config` (built by its family) as TP rank 0 of `tp` builds it (every TP rank's shapes are the
    same), on meta tensors; `stage`: a pipeline rank's part (`mpzero.models.ModelStage`), None: the whole model;
    `ep`, `etp`: a mixture of experts' expert-parallel and expert-TP sizes (None: TP; every EP rank holds as many
    experts)."""
    group, build = CommGroup(None, tuple(range(tp)), 0), family_of(config).build
    kwargs = {} if stage is None else {"stage": stage}
    if ep > 1 or (etp is not None and etp != tp):
        kwargs.update(ep=CommGroup(None, tuple(range(ep)), 0),
                      expert_tp=CommGroup(None, tuple(range(etp)), 0) if etp not in (None, tp) else group)
    with no_data("meta"):
        model = build(config, group, RNGStatesTracker(torch.device("cpu")), device=engine_device("meta"), **kwargs)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    mark_weight_decay(named, None)  # ZeroOptimizer's default rule, recorded as it records it
    return ModelShapes(config, tp, model, tuple(named))
