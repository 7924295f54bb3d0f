"""Full fp32 weights for export: this TP rank's model, keyed by parameter name, assembled from every DP rank's
master slices (a collective over the DP group). Checkpoints do not use it: each rank writes and reads its own
pieces in place (`MasterStore.owned_pieces`), with no gather.
"""

from __future__ import annotations

import torch
from torch import nn

from mpzero.comm import CommGroup
from mpzero.zero.flat import FlatLayout


def _gather_flat(layout: FlatLayout, shard: torch.Tensor, dp: CommGroup) -> torch.Tensor:
    if layout.parts == 1:
        return shard
    full = torch.empty(layout.padded_numel, dtype=shard.dtype, device=shard.device)
    dp.all_gather_into(full, shard)
    return full


def consolidated_weights(model: nn.Module, layouts: list[FlatLayout], masters: list[torch.Tensor],
                         dp: CommGroup | list[CommGroup]) -> dict[str, torch.Tensor]:
    """{name: full fp32 tensor} for every parameter (frozen ones from the model), in model order. `dp`: the group
    the buckets are partitioned over, or one per bucket (families.py: expert buckets over the expert-DP group);
    expert stacks are this rank's experts."""
    groups = dp if isinstance(dp, list) else [dp] * len(layouts)
    managed = {}
    for layout, master, group in zip(layouts, masters, groups):
        full = _gather_flat(layout, master, group)
        for i, name in enumerate(layout.names):
            managed[name] = layout.param_view(full, i).clone()
    return {name: managed[name] if name in managed else p.detach().float().clone()
            for name, p in model.named_parameters()}
