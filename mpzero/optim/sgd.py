"""SGD with momentum (`--optimizer sgd`), as Megatron-LM builds it: `SGD(param_groups, lr, weight_decay,
momentum=--sgd-momentum)` (megatron/core/optimizer/__init__.py; default momentum 0.9, optimizer_config.py) from
Transformer Engine's or Apex's FusedSGD, else torch.optim.SGD: no dampening, no Nesterov, and weight decay added
to the gradient (L2, coupled; not decoupled as in AdamW), on the parameters whose group has wd_mult 1 (not
biases or other 1-D parameters: the same decay rule as AdamW's here). torch.optim.SGD's single-tensor arithmetic,
op for op, so ZeRO's partitions match it bit for bit:

    d = g + wd p;   b = d at the first step, else b = momentum b + d;   p -= lr b
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

import torch

from mpzero.errors import ConfigError
from mpzero.optim.rule import UpdateRule


def sgd_reference(params: torch.Tensor, grads: torch.Tensor, momentum_buffer: torch.Tensor,
                  model_copy: torch.Tensor | None, lr: float, momentum: float, weight_decay: float,
                  step: int) -> None:
    """torch.optim.SGD's `_single_tensor_sgd` (dampening 0, not Nesterov), in place on flat fp32 tensors."""
    grad = grads.float()
    if weight_decay != 0:
        grad = grad.add(params, alpha=weight_decay)
    if step == 1 or momentum == 0:  # torch's first step copies the gradient (momentum 0: it keeps no buffer)
        momentum_buffer.copy_(grad)
    else:
        momentum_buffer.mul_(momentum).add_(grad, alpha=1)
    params.add_(momentum_buffer, alpha=-lr)
    if model_copy is not None:
        model_copy.copy_(params)


@dataclass(frozen=True)
class SGD(UpdateRule):
    """One fp32 state per parameter, the momentum buffer: K = 4 + 4 in mixed precision, 4 in fp32."""
    momentum: float = 0.9  # --sgd-momentum

    name: ClassVar[str] = "sgd"
    state_names: ClassVar[tuple[str, ...]] = ("momentum_buffer",)
    flag_ranges: ClassVar[dict] = {"sgd_momentum": (0.0, True, None, False)}

    def validate(self) -> None:
        if not self.momentum >= 0:
            raise ConfigError(f"--sgd-momentum {self.momentum} must be >= 0")

    def resolve_impl(self, device: torch.device | str, impl: str) -> str:
        if impl not in ("auto", "torch"):
            raise ConfigError(f"--optimizer sgd has one implementation, torch's arithmetic; {impl!r} was asked for")
        return "torch"

    def step(self, master, grad, states, *, lr, weight_decay, step, impl, model_copy=None) -> None:
        if step < 1:
            raise ConfigError(f"SGD: step counts from 1 (torch's convention), got {step}")
        sgd_reference(master, grad, states["momentum_buffer"], model_copy, lr, self.momentum, weight_decay, step)

    @staticmethod
    def add_flags(group: argparse._ArgumentGroup) -> None:
        group.add_argument("--sgd-momentum", type=float, default=SGD.momentum,
                           help="momentum factor of --optimizer sgd (Megatron's default 0.9)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SGD:
        return cls(momentum=args.sgd_momentum)
