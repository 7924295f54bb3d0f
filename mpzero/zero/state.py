"""Stage- and layout-independent views of the ZeRO state: full fp32 weights for export, the optimizer
state keyed by parameter name (full tensors of this TP rank; gathering is a collective over the DP group),
and, for checkpoints, this rank's own pieces of it by parameter name and element range, without a copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mpzero.comm import CommGroup
from mpzero.errors import ConfigError
from mpzero.zero.adam import MasterAdam
from mpzero.zero.flat import FlatLayout

KEYS = ("exp_avg", "exp_avg_sq")


def _gather_flat(layout: FlatLayout, shard: torch.Tensor, dp: CommGroup) -> torch.Tensor:
    if layout.parts == 1:
        return shard
    full = torch.empty(layout.padded_numel, dtype=shard.dtype, device=shard.device)
    dp.all_gather_into(full, shard)
    return full


def _per_param(layouts: list[FlatLayout], shards: list[torch.Tensor], dp: CommGroup) -> dict:
    out = {}
    for layout, shard in zip(layouts, shards):
        full = _gather_flat(layout, shard, dp)
        for i, name in enumerate(layout.names):
            out[name] = layout.param_view(full, i).clone()
    return out


def _moment_shards(layouts: list[FlatLayout], masters, adam: MasterAdam, key: str) -> list[torch.Tensor]:
    # on the masters' device: NCCL gathers only CUDA tensors
    shards = [torch.zeros(l.shard_numel, dtype=torch.float32, device=m.device) for l, m in zip(layouts, masters)]
    for bucket, start, end, view in adam.runs:
        shards[bucket][start:end] = adam.moments(view)[key]
    return shards


def consolidated_weights(model: nn.Module, layouts, masters, dp: CommGroup) -> dict[str, torch.Tensor]:
    """{name: full fp32 tensor} for every parameter (frozen ones from the model), in model order."""
    managed = _per_param(layouts, masters, dp)
    return {name: managed[name] if name in managed else p.detach().float().clone()
            for name, p in model.named_parameters()}


def optimizer_state(layouts, masters, adam: MasterAdam, dp: CommGroup) -> dict:
    tensors = {"master": _per_param(layouts, masters, dp)}
    for key in KEYS:
        tensors[key] = _per_param(layouts, _moment_shards(layouts, masters, adam, key), dp)
    return {"params": {name: {key: tensors[key][name] for key in tensors} for name in tensors["master"]}}


def load_optimizer_state(state: dict, layouts: list[FlatLayout], masters, adam: MasterAdam) -> None:
    """Copies this rank's slices out of full per-parameter tensors into masters and moments (the step count,
    scaler and parameters are the caller's: `ZeroOptimizer.load_state_dict`)."""
    missing = [name for layout in layouts for name in layout.names if name not in state["params"]]
    if missing:
        raise ConfigError(f"optimizer state has no entry for parameters {missing[:3]}: it was saved from "
                          "another model; load a checkpoint of this one")
    for key in ("master",) + KEYS:
        for bucket, layout in enumerate(layouts):
            full = torch.zeros(layout.padded_numel, dtype=torch.float32, device=masters[bucket].device)
            for i, name in enumerate(layout.names):
                layout.param_view(full, i).copy_(state["params"][name][key])
            shard = full[layout.shard_start:layout.shard_start + layout.shard_numel]
            if key == "master":
                masters[bucket].copy_(shard)
                continue
            for b, start, end, view in adam.runs:
                if b == bucket:
                    adam.moments(view)[key].copy_(shard[start:end])


@dataclass(frozen=True)
class OwnedPiece:
    """A run of one parameter's elements that this rank's optimizer state holds: elements [start, end) of the
    parameter's flattened (TP-local) tensor, and 1-D views of the fp32 master and Adam moments over them.
    Writing through the views writes the optimizer state itself."""
    name: str
    shape: torch.Size
    start: int
    end: int
    tensors: dict[str, torch.Tensor]


def owned_pieces(layouts: list[FlatLayout], masters, adam: MasterAdam) -> list[OwnedPiece]:
    """Every piece of state this rank owns, without copying (checkpoints read and write these in place)."""
    runs = {}
    for bucket, start, end, view in adam.runs:
        runs.setdefault(bucket, []).append((start, end, adam.moments(view)))
    pieces = []
    for bucket, (layout, master) in enumerate(zip(layouts, masters)):
        for i, start, end in layout.owned_pieces():
            run_start, _, moments = next(r for r in runs[bucket] if r[0] <= start and end <= r[1])
            offset = layout.shard_start + start - layout.offsets[i]  # where the piece begins in the parameter
            tensors = {"master": master[start:end]}
            tensors.update({key: moments[key][start - run_start:end - run_start] for key in KEYS})
            pieces.append(OwnedPiece(layout.names[i], layout.shapes[i], offset, offset + end - start, tensors))
    return pieces
