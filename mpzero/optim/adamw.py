"""AdamW (`--optimizer adam`, the default): decoupled weight decay, torch.optim.AdamW's arithmetic, through the
fused `adamw_step` (implementations torch / compile / torch_fused / triton, mpzero.fused.adam)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

import torch

from mpzero.errors import ConfigError
from mpzero.fused import (ADAMW_DEVICE_SKIP_IMPLS, ADAMW_MASKED_IMPLS, adamw_masked_step, adamw_scalars,
                          adamw_step, resolve_impl)
from mpzero.optim.rule import UpdateRule


@dataclass(frozen=True)
class AdamW(UpdateRule):
    """m = lerp(m, g, 1 - beta1); v = beta2 v + (1 - beta2) g^2; p = p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)."""
    beta1: float = 0.9  # --adam-beta1
    beta2: float = 0.999  # --adam-beta2
    eps: float = 1e-8  # --adam-eps

    name: ClassVar[str] = "adam"
    state_names: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq")
    flag_ranges: ClassVar[dict] = {"adam_beta1": (0.0, True, 1.0, False), "adam_beta2": (0.0, True, 1.0, False),
                                   "adam_eps": (0.0, False, None, False)}

    def validate(self) -> None:
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0):
            raise ConfigError(f"--adam-beta1 {self.beta1} and --adam-beta2 {self.beta2} must lie in [0, 1)")
        if not self.eps > 0:
            raise ConfigError(f"--adam-eps {self.eps} must be > 0")

    def resolve_impl(self, device: torch.device | str, impl: str) -> str:
        return resolve_impl("adamw_step", device, impl)

    def folds_grad_scale(self, impl: str) -> bool:
        return impl == "triton"  # the kernel multiplies as it reads the gradient

    def skips_on_device(self, impl: str) -> bool:
        return impl in ADAMW_DEVICE_SKIP_IMPLS  # Triton's kernel and torch's fused one (its found_inf)

    def step(self, master, grad, states, *, lr, weight_decay, step, impl, model_copy=None, grad_scale=1.0,
             skip=None) -> None:
        adamw_step(master, grad, states["exp_avg"], states["exp_avg_sq"], lr=lr, beta1=self.beta1,
                   beta2=self.beta2, eps=self.eps, weight_decay=weight_decay, step=step, impl=impl,
                   model_copy=model_copy, grad_scale=grad_scale, skip=skip)

    def skips_with_device_scalars(self, impl: str) -> bool:
        return impl in ADAMW_MASKED_IMPLS

    def masked_scalars(self, lr: float, weight_decay: float, step: int) -> tuple[float, ...]:
        return adamw_scalars(lr, weight_decay, self.beta1, self.beta2, step)

    def step_masked(self, master, grad, states, scalars, model_copy, skip, impl: str) -> None:
        adamw_masked_step(master, grad, states["exp_avg"], states["exp_avg_sq"], model_copy, scalars, self.beta1,
                          self.beta2, self.eps, skip, impl)

    @staticmethod
    def add_flags(group: argparse._ArgumentGroup) -> None:
        group.add_argument("--adam-beta1", type=float, default=AdamW.beta1)
        group.add_argument("--adam-beta2", type=float, default=AdamW.beta2)
        group.add_argument("--adam-eps", type=float, default=AdamW.eps)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> AdamW:
        return cls(beta1=args.adam_beta1, beta2=args.adam_beta2, eps=args.adam_eps)
