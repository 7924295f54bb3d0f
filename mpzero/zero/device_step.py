"""The optimizer step with no host synchronisation (issue 46): `ZeroOptimizer.launch_step`.

The synchronising step (`check_gradients` + `step`) reads the global gradient norm to the host, decides there
(clip coefficient, the non-finite check) and only then launches the update: on a GPU the update waits for that
round trip every iteration. Here the decisions stay on the device:
- the clipping coefficient is `norm.clip_coefficient_on_device` of the squared norm, a 0-dim fp32 tensor equal bit
  for bit to the host's float as a kernel takes it (AdamW's Triton kernel reads it from memory; torch's fused
  kernel's gradients are multiplied by it first, as the synchronising step multiplies them by the float);
- --check-for-nan-in-loss-and-grad: a non-finite norm (or a non-finite `watch` value: the loop's loss) sets a
  device flag `halted` that the update takes as its skip flag (torch's fused AdamW: `found_inf`; the Triton
  kernel: no write), so the parameters, moments and model copy stay as they were, as when the synchronising step
  stops before the update. The flag latches: every later update is skipped too, until the caller reads it and
  stops (the training loop: at its next read, the next log line, with the iteration it happened at).
Without the check (--no-check-for-nan-in-loss-and-grad) nothing is skipped, as in the synchronising step.

Where a step needs the host anyway it is the synchronising one (`steps_on_device` False): fp16 (the loss scaler
backs off on the host), an offloaded optimizer (its step runs on the host), the delayed update, gradients on disk,
and update rules that cannot skip on a device flag (SGD, AdamW's reference arithmetic, --no-adam-fusion).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpzero.zero.norm import clip_coefficient_on_device, grad_norm_squared
from mpzero.zero.step_grads import Fp32Buckets


@dataclass(frozen=True)
class DeviceStep:
    """What a launched step leaves on the device for the caller to read when it next synchronises."""
    squared_norm: torch.Tensor  # fp64, the global norm's square before clipping (the same on every rank)
    halted: torch.Tensor | None  # bool: this or an earlier launched step found a non-finite value and was skipped


def steps_on_device(optimizer) -> bool:
    """Whether `optimizer` (a ZeroOptimizer) can launch its step without reading the device (module docstring)."""
    masters = optimizer.masters
    return (optimizer.precision.dtype != "fp16" and optimizer.offload.optimizer == "none"
            and optimizer._delayed is None and optimizer.stage.gradient_file is None
            and optimizer.rule.skips_on_device(getattr(masters, "impl", "torch")))


def launch_step(optimizer, lr: float, watch: tuple[torch.Tensor, ...]) -> DeviceStep:
    """One update of `optimizer` with no device-to-host read (see the module docstring)."""
    optimizer._add_tied_gradients()  # tied across pipeline stages: both stages' gradients, as check_gradients adds
    grads = optimizer._fp32_grads()
    cast = isinstance(grads, Fp32Buckets)
    squared = grad_norm_squared(grads.shards if cast else grads, optimizer._norm_runs, optimizer.groups,
                                scale=grads.inverse_scale if cast else 1.0)
    if optimizer.zero.check_for_nan_in_grad:
        bad = ~torch.isfinite(squared)
        for value in watch:
            bad = bad | ~torch.isfinite(value.to(squared.device))
        optimizer._halted = bad if optimizer._halted is None else optimizer._halted | bad
    coef = clip_coefficient_on_device(squared, optimizer.config.clip_grad)
    optimizer.masters.step(grads, lr, grad_scale=1.0 if coef is None else coef, skip=optimizer._halted)
    if cast:  # the fp32 copies go; their high-water mark stays for the report
        grads.release()
        optimizer.step_fp32_peak = max(optimizer.step_fp32_peak, grads.meter.peak)
    optimizer.stage.after_update()
    return DeviceStep(squared, optimizer._halted)
