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
from mpzero.tensor_parallel import RNGStatesTracker
from mpzero.zero import (FlatLayout, assign_params, bucket_layouts, build_layout, default_units, layer_units,
                         mark_weight_decay, predicted_trace, recompute_chunks)


@dataclass(frozen=True, eq=False)
class ModelShapes:
    """One TP rank's model (meta tensors) and its trainable parameters in registration order."""
    config: object  # the family's config (`mpzero.models.family_of`)
    tp: int
    model: nn.Module
    named: tuple[tuple[str, nn.Parameter], ...]

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.named)

    @property
    def largest_param(self) -> int:
        return max(p.numel() for _, p in self.named)

    def layer_numel(self) -> int:
        """Trainable elements of one transformer layer (of this TP rank)."""
        return sum(p.numel() for p in self.model.layers[0].parameters() if p.requires_grad)

    @functools.lru_cache(maxsize=None)
    def layouts(self, stage: int, dp: int, dp_rank: int, bucket_numel: int,
                units: str = "layer") -> tuple[FlatLayout, ...]:
        """The flat layouts `ZeroOptimizer` builds for this model: buckets (stages 0-2; replicated at stage 0)
        or the root and one unit per layer (or, `units` "linear", per linear layer) with trainable parameters
        (stage 3)."""
        if stage == 3:
            assigned, kept = self._units(units)
            return tuple(build_layout(assigned[u], dp, dp_rank) for u in kept)
        parts, rank = (dp, dp_rank) if stage > 0 else (1, 0)
        return tuple(bucket_layouts(list(self.named), bucket_numel, parts, rank))

    @functools.lru_cache(maxsize=None)
    def _units(self, units: str) -> tuple[list, tuple[int, ...]]:
        """Stage3's rule: the parameters of [root, unit 1, ...] and the units kept (the root, then those that hold
        trainable parameters)."""
        assigned = assign_params(self.model, default_units(self.model, units), list(self.named))
        return assigned, (0,) + tuple(u for u in range(1, len(assigned)) if assigned[u])

    @functools.lru_cache(maxsize=None)
    def stage3_trace(self, units: str = "layer", recomputed: tuple[tuple[int, ...], ...] = ()
                     ) -> tuple[tuple[int, str], ...]:
        """The demand trace `Stage3` records for this model (`schedule3.predicted_trace`): its layers' units, with
        the layers full recomputation replays together (`full_recompute_chunks`; the shapes' own config is
        normalized, without recomputation)."""
        modules = default_units(self.model, units)
        layers = layer_units(self.model, modules, list(self._units(units)[1][1:]))
        return tuple(predicted_trace(layers, [list(chunk) for chunk in recomputed]))


def full_recompute_chunks(config) -> tuple[tuple[int, ...], ...]:
    """The layers of `config` that full recomputation replays together (`schedule3.recompute_chunks`)."""
    chunks = recompute_chunks(config.num_layers, config.resolved_recompute_method,
                              config.resolved_recompute_num_layers)
    return tuple(tuple(chunk) for chunk in chunks)


@functools.lru_cache(maxsize=64)
def model_shapes(config, tp: int, stage=None) -> ModelShapes:
    """The model of `config` (built by its family) as TP rank 0 of `tp` builds it (every TP rank's shapes are the
    same), on meta tensors; `stage`: a pipeline rank's part (`mpzero.models.ModelStage`), None: the whole model."""
    group, build = CommGroup(None, tuple(range(tp)), 0), family_of(config).build
    kwargs = {} if stage is None else {"stage": stage}
    with no_data("meta"):
        model = build(config, group, RNGStatesTracker(torch.device("cpu")), device=engine_device("meta"), **kwargs)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    mark_weight_decay(named, None)  # ZeroOptimizer's default rule, recorded as it records it
    return ModelShapes(config, tp, model, tuple(named))
