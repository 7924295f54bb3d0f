"""Contiguous flat buffers for one bucket of parameters, partitioned across the DP group.

ZeRO-R keeps parameters, gradients and optimizer states in contiguous buffers so that nothing
fragments and every collective is one call on one tensor. A `FlatLayout` says where each parameter
lives inside its bucket's flat buffer and which slice this rank owns: parameters are laid end to end,
weight-decayed ones first (so a rank's slice is at most two runs, one decayed and one not), and the
total is padded to a multiple of the number of parts, so each rank owns exactly `shard_numel`
elements [rank*S, (rank+1)*S). Every bucket is partitioned on its own, so reducing a bucket is one
reduce-scatter whose output is this rank's slice of that bucket; the padding is < parts per bucket.

Which parameters decay is the optimizer's parameter (`ZeroOptimizer(..., decay=...)`): it resolves its rule
once, at construction, and records each parameter's answer on the parameter (`mark_weight_decay`), the way
parameters carry their TP placement; the layouts read the record. Unrecorded parameters follow Megatron's
rule (`default_decay`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import nn

from mpzero.deferred_init import bind, materialize
from mpzero.errors import ConfigError
from mpzero.tensor_parallel import is_expert, is_pipeline_tied

DecayRule = Callable[[str, nn.Parameter], bool]
_DECAY_ATTR = "zero_weight_decay"  # set by mark_weight_decay: True / False


def default_decay(name: str, param: nn.Parameter) -> bool:
    """Megatron's rule: no weight decay on biases and LayerNorm parameters (ndim < 2; an expert stack by its
    experts' own ndim: stacked biases are 1-D per expert)."""
    return param.ndim - is_expert(param) >= 2


def mark_weight_decay(named_params: list[tuple[str, nn.Parameter]],
                      decay: DecayRule | Collection[str] | None = None) -> dict[str, bool]:
    """Decide, for every (name, parameter), whether AdamW decays it, and record it on the parameter for the
    layouts. `decay`: None (Megatron's rule, `default_decay`), a function (name, parameter) -> bool, or the
    names of the parameters that decay (every other one does not). Returns {name: decays}."""
    names = [name for name, _ in named_params]
    if decay is None:
        rule = default_decay
    elif callable(decay):
        rule = decay
    elif isinstance(decay, Collection) and not isinstance(decay, (str, bytes)):
        chosen = set(decay)
        unknown = sorted(chosen - set(names))
        if unknown:
            raise ConfigError(f"decay names {', '.join(map(repr, unknown[:3]))}"
                              f"{' and more' if len(unknown) > 3 else ''}, not trainable parameters of the model "
                              f"(they are e.g. {', '.join(map(repr, names[:3]))})")
        rule = lambda name, param: name in chosen  # noqa: E731
    else:
        raise ConfigError(f"decay must be None, a function (name, parameter) -> bool or a set of parameter names, "
                          f"not {type(decay).__name__}")
    decisions = {}
    for name, param in named_params:
        answer = rule(name, param)
        if not isinstance(answer, bool):
            raise ConfigError(f"the decay rule returned {answer!r} for parameter {name!r}: it must return True or "
                              f"False")
        setattr(param, _DECAY_ATTR, answer)
        decisions[name] = answer
    return decisions


def uses_weight_decay(param: nn.Parameter) -> bool:
    """What `mark_weight_decay` recorded for this parameter; Megatron's rule when nothing was recorded."""
    recorded = getattr(param, _DECAY_ATTR, None)
    return default_decay("", param) if recorded is None else recorded


@dataclass(frozen=True, eq=False)
class FlatLayout:
    params: tuple[nn.Parameter, ...]
    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int  # sum of the parameters' sizes, padding excluded
    decay_numel: int  # elements [0, decay_numel) belong to weight-decayed parameters
    parts: int  # how many ranks share this buffer (1 when replicated)
    rank: int  # which part this rank owns

    @property
    def padded_numel(self) -> int:
        return -(-self.numel // self.parts) * self.parts

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.parts

    @property
    def shard_start(self) -> int:
        return self.rank * self.shard_numel

    def param_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        start = self.offsets[i]
        return flat[start:start + self.shapes[i].numel()].view(self.shapes[i])

    def owned_pieces(self) -> list[tuple[int, int, int]]:
        """(param index, start, end) in shard coordinates for every parameter overlapping this rank's slice."""
        lo, hi = self.shard_start, self.shard_start + self.shard_numel
        pieces = []
        for i, (offset, shape) in enumerate(zip(self.offsets, self.shapes)):
            start, end = max(offset, lo), min(offset + shape.numel(), hi)
            if start < end:
                pieces.append((i, start - lo, end - lo))
        return pieces

    def decay_runs(self) -> list[tuple[int, int, bool]]:
        """(start, end, weight_decay) runs of this rank's slice in shard coordinates, padding excluded."""
        lo, hi = self.shard_start, self.shard_start + self.shard_numel
        runs = []
        for start, end, decay in ((0, self.decay_numel, True), (self.decay_numel, self.numel, False)):
            start, end = max(start, lo), min(end, hi)
            if start < end:
                runs.append((start - lo, end - lo, decay))
        return runs


def build_layout(named_params: list[tuple[str, nn.Parameter]], parts: int, rank: int) -> FlatLayout:
    ordered = ([(n, p) for n, p in named_params if uses_weight_decay(p)]
               + [(n, p) for n, p in named_params if not uses_weight_decay(p)])
    offsets, total = [], 0
    for _, p in ordered:
        offsets.append(total)
        total += p.numel()
    decay_numel = sum(p.numel() for _, p in ordered if uses_weight_decay(p))
    return FlatLayout(params=tuple(p for _, p in ordered), names=tuple(n for n, _ in ordered),
                      shapes=tuple(p.shape for _, p in ordered), offsets=tuple(offsets), numel=total,
                      decay_numel=decay_numel, parts=parts, rank=rank)


def bucket_layouts(named_params: list[tuple[str, nn.Parameter]], bucket_numel: int, parts: int,
                   rank: int) -> list[FlatLayout]:
    """Buckets of about `bucket_numel` elements in reverse registration order, the order in which
    backward usually produces gradients, so the first bucket fills (and can be reduced) first. A parameter tied
    across pipeline stages (`is_pipeline_tied`) has a bucket of its own, partitioned the same on both stages, so
    its reduced gradient slices can be added across them."""
    buckets, current, size = [], [], 0
    for name, param in reversed(named_params):
        if is_pipeline_tied(param):
            buckets += [current, [(name, param)]] if current else [[(name, param)]]
            current, size = [], 0
            continue
        current.append((name, param))
        size += param.numel()
        if size >= bucket_numel:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return [build_layout(b, parts, rank) for b in buckets]


def initial_values(layout: FlatLayout, device: torch.device) -> torch.Tensor:
    """The parameters' current values as one padded fp32 flat tensor (padding zero); a deferred parameter is
    made from its recipe (`mpzero.deferred_init`), one at a time."""
    flat = torch.zeros(layout.padded_numel, dtype=torch.float32, device=device)
    for i, param in enumerate(layout.params):
        layout.param_view(flat, i).copy_(materialize(param))
    return flat


def bind_params(layout: FlatLayout, flat: torch.Tensor) -> None:
    """Make every parameter of the bucket a view into `flat` (its values are used from then on)."""
    for i, param in enumerate(layout.params):
        bind(param, layout.param_view(flat, i))
