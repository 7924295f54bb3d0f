"""Deferred initialization: a model is built without storage, and each parameter is made when it is needed.

A model's parameters are created without storage (a tensor of the right shape whose storage holds 0 bytes: it
takes any device's data later through `param.data =`, which a meta tensor refuses), each with a recipe
(`Recipe`): the shape of the FULL tensor (before tensor parallelism splits it), how to fill it, and how this TP
rank's shard is cut from it. The draws of a
parameter come from its own CPU generator, seeded from (the model's init seed, the parameter's name), so a
parameter's values do not depend on which parameters were drawn before it, on the device, or on the order in
which anything is made: the whole model built at once and the same model streamed into ZeRO's buffers one
unit at a time (DeepSpeed's zero.Init, torchtitan's meta-device init) hold the same weights, bit for bit, at every
TP x DP x stage x offload tier. Making a parameter holds its full fp32 tensor on the host for a moment (TP
invariance: every rank draws the whole weight and keeps its slice), never more than one parameter at a time.

    model = GPTModel(config, tp, device="meta")       # nothing made, every parameter has its recipe
    opt = ZeroOptimizer(model, groups, ...)           # materializes each unit or bucket, straight into its shard
    model = GPTModel(config, tp, device="cpu")        # the whole build: the same values, made at once

The keys are set by `name_parameters(model)` (the model's own parameter names, so wrapping the model in another
module does not change its weights); `materialize(param)` returns the values; `bind(param, tensor)` gives a
parameter its storage and drops its recipe (a parameter with storage is made: ZeRO stage 3 frees and refills the
storage of made parameters, which must not look deferred then). Reading a deferred parameter is torch's error
("data is not allocated"), never stale bytes.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

Fill = Callable[[torch.Tensor, torch.Generator], None]  # fills a full fp32 host tensor in place
Shard = Callable[[torch.Tensor], torch.Tensor]  # the full tensor -> this rank's part of it


def _whole(full: torch.Tensor) -> torch.Tensor:
    return full


@dataclass
class Recipe:
    full_shape: tuple[int, ...]
    fill: Fill
    shard: Shard = _whole
    seed: int | None = None  # set with the key by `name_parameters`
    key: str | None = None

    def values(self, meter=None) -> torch.Tensor:
        """This rank's part of the parameter, fp32, on the host, contiguous. `meter` (add/sub of bytes): counts
        the full tensor and a copied part while both live; what is returned stays counted (its storage's bytes)
        until the caller subtracts them."""
        if self.key is None:
            raise RuntimeError("a deferred parameter has no key: call name_parameters(model, seed) after building it")
        full = torch.empty(self.full_shape, dtype=torch.float32)
        if meter is not None:
            meter.add(full.numel() * 4)
        self.fill(full, parameter_generator(self.seed, self.key))
        part = self.shard(full).contiguous()
        if meter is not None and not _shares_storage(part, full):
            meter.add(part.numel() * 4)  # the copy and the full tensor, both alive here
            meter.sub(full.numel() * 4)  # the full tensor goes with this frame
        return part

    def drawn_bytes(self) -> int:
        """The host bytes making this parameter holds at its peak: the full tensor, and this rank's part when that
        is a copy rather than a view."""
        full = torch.empty(self.full_shape, dtype=torch.float32, device="meta")
        part = self.shard(full).contiguous()
        return 4 * (full.numel() + (0 if _shares_storage(part, full) else part.numel()))


def _shares_storage(part: torch.Tensor, full: torch.Tensor) -> bool:
    return part is full or part._base is full


def parameter_generator(seed: int, key: str) -> torch.Generator:
    """The CPU generator of one parameter: seeded from (seed, key) through SHA-256, so no two keys share draws."""
    digest = hashlib.sha256(f"{seed}/{key}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def deferred_parameter(full_shape: tuple[int, ...], fill: Fill, shard: Shard = _whole) -> nn.Parameter:
    """A parameter of this rank's shape without storage, with the recipe that makes it."""
    recipe = Recipe(tuple(full_shape), fill, shard)
    local_shape = shard(torch.empty(full_shape, device="meta")).shape
    tensor = torch.empty(local_shape)  # the default device (meta or fake under the planner's engines)
    tensor.untyped_storage().resize_(0)  # (pages never touched: nothing is held)
    param = nn.Parameter(tensor)
    param.init_recipe = recipe
    return param


@dataclass
class ExpertRecipe(Recipe):
    """A stack of experts (a mixture-of-experts layer's): `full_shape` is one expert's whole weight, `experts` the
    global indices of the experts this rank holds; expert E is drawn from its own generator, keyed by its global
    name (the key with the index inserted before its last part: `layers.1.mlp.experts.weight1` ->
    `layers.1.mlp.experts.5.weight1`), and `shard` cuts this rank's part of each. The stack is the same at every
    expert-parallel and expert-tensor-parallel size, expert by expert."""
    experts: range = range(0)

    def expert_key(self, expert: int) -> str:
        prefix, _, leaf = self.key.rpartition(".")
        return f"{prefix}.{expert}.{leaf}" if prefix else f"{expert}.{leaf}"

    def values(self, meter=None) -> torch.Tensor:
        if self.key is None:
            raise RuntimeError("a deferred parameter has no key: call name_parameters(model, seed) after building it")
        part_shape = tuple(self.shard(torch.empty(self.full_shape, device="meta")).shape)
        stack = torch.empty((len(self.experts),) + part_shape, dtype=torch.float32)
        if meter is not None:
            meter.add(stack.numel() * 4)  # stays counted: the caller's
        for i, expert in enumerate(self.experts):  # one expert's whole weight at a time beside the stack
            full = torch.empty(self.full_shape, dtype=torch.float32)
            if meter is not None:
                meter.add(full.numel() * 4)
            self.fill(full, parameter_generator(self.seed, self.expert_key(expert)))
            stack[i].copy_(self.shard(full))
            del full
            if meter is not None:
                meter.sub(math.prod(self.full_shape) * 4)
        return stack

    def drawn_bytes(self) -> int:
        """One expert's whole weight and the stack of this rank's parts."""
        full = torch.empty(self.full_shape, dtype=torch.float32, device="meta")
        return 4 * (full.numel() + len(self.experts) * self.shard(full).numel())


def deferred_expert_parameter(expert_shape: tuple[int, ...], experts: range, fill: Fill,
                              shard: Shard = _whole) -> nn.Parameter:
    """A stack [len(experts), ...] of expert weights without storage, each drawn by its global name
    (`ExpertRecipe`)."""
    recipe = ExpertRecipe(tuple(expert_shape), fill, shard, experts=experts)
    local_shape = (len(experts),) + tuple(shard(torch.empty(expert_shape, device="meta")).shape)
    tensor = torch.empty(local_shape)
    tensor.untyped_storage().resize_(0)
    param = nn.Parameter(tensor)
    param.init_recipe = recipe
    return param


def recipe_of(param: torch.Tensor) -> Recipe | None:
    return getattr(param, "init_recipe", None)


def name_parameters(module: nn.Module, seed: int) -> None:
    """Key every deferred parameter of `module` by its name in `module` and seed its draws with `seed`."""
    for name, param in module.named_parameters():
        recipe = getattr(param, "init_recipe", None)
        if recipe is not None:
            recipe.seed, recipe.key = seed, name


def materialize(param: torch.Tensor) -> torch.Tensor:
    """The parameter's values: made from its recipe when it has no storage yet, else its own (detached)."""
    recipe = recipe_of(param)
    return recipe.values() if recipe is not None else param.detach()


def is_deferred(param: torch.Tensor) -> bool:
    return recipe_of(param) is not None


def bind(param: nn.Parameter, tensor: torch.Tensor) -> None:
    """`param` now holds `tensor` (a view: the parameter shares its storage); it is made, its recipe dropped."""
    param.data = tensor
    param.init_recipe = None


def materialize_module(module: nn.Module, device: torch.device | str | None = None) -> None:
    """Make every deferred parameter of `module` now, on `device` (None: the default device; the whole build)."""
    for param in module.parameters():
        if is_deferred(param):
            values = materialize(param)
            bind(param, values if device is None else values.to(device))
