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

fp16 (`launch_fp16_step`): the loss scaler lives on the device (device_scaler.py); an overflow (the all-reduced
squared norm of the scaled gradients is not finite) skips the update by the device flag, and the learning rate and
AdamW's step count are picked on the device by the number of launched steps skipped so far (fused/adam_scalars.py),
so a skipped iteration advances neither, as in the synchronising loop. `settle` brings the scaler and the skip count
to the host at the caller's read. The update rule must repeat its synchronising arithmetic with device scalars
(`skips_with_device_scalars`: AdamW's reference, --no-adam-fusion).

Where a step needs the host anyway it is the synchronising one (`steps_on_device` False): an offloaded optimizer (its
step runs on the host), the delayed update, gradients on disk, and update rules that cannot skip on a device flag:
in bf16 and fp32 SGD and AdamW's reference arithmetic (--no-adam-fusion); in fp16 SGD, torch's fused AdamW and the
Triton kernel (which take the learning rate and step count from the host), so fp16 launches with --no-adam-fusion.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpzero.errors import TrainingError
from mpzero.zero.device_scaler import DeviceLossScaler
from mpzero.zero.norm import clip_coefficient_on_device, grad_norm_squared
from mpzero.zero.step_grads import Fp32Buckets


@dataclass(frozen=True)
class DeviceStep:
    """What a launched step leaves on the device for the caller to read when it next synchronises."""
    squared_norm: torch.Tensor  # fp64, the global norm's square before clipping (the same on every rank)
    halted: torch.Tensor | None  # bool: this or an earlier launched step found a non-finite value and was skipped
    found_inf: torch.Tensor | None = None  # fp16: bool, the gradients overflowed and the update was skipped
    loss_scale: torch.Tensor | None = None  # fp16: fp64, the scale this step's backward used
    skipped_before: torch.Tensor | None = None  # fp16: int64, launched steps skipped since the last settle, before it


def steps_on_device(optimizer) -> bool:
    """Whether `optimizer` (a ZeroOptimizer) can launch its step without reading the device (module docstring)."""
    impl = getattr(optimizer.masters, "impl", "torch")
    rule = optimizer.rule
    return (optimizer.offload.optimizer == "none" and optimizer._delayed is None
            and optimizer.stage.gradient_file is None
            and (rule.skips_with_device_scalars(impl) if optimizer.precision.dtype == "fp16"
                 else rule.skips_on_device(impl)))


def launch(optimizer, lr: float | list[float] | None, watch: tuple[torch.Tensor, ...]) -> DeviceStep:
    """`ZeroOptimizer.launch_step`'s update: fp16's (`launch_fp16_step`) or the others' (`launch_step`)."""
    lrs = lr if isinstance(lr, list) else [optimizer.lr if lr is None else lr] * (optimizer.unsettled_steps + 1)
    optimizer.lr = lrs[0]
    if optimizer.precision.dtype != "fp16":
        launched = launch_step(optimizer, optimizer.lr, watch)
        optimizer.scaler.update(False)
        return launched
    if len(lrs) != optimizer.unsettled_steps + 1:
        raise ValueError(f"launch_step: {len(lrs)} learning rates for {optimizer.unsettled_steps + 1} possible "
                         "counts of skipped steps")
    launched = launch_fp16_step(optimizer, lrs, watch)
    optimizer.unsettled_steps += 1
    return launched


def device_scaler(optimizer) -> DeviceLossScaler:
    """fp16's scaler on the device, made from the host's at the first launched step (device_scaler.py)."""
    if optimizer._device_scaler is None:
        optimizer._device_scaler = DeviceLossScaler(optimizer.scaler, optimizer.groups.device)
    return optimizer._device_scaler


def settle_values(optimizer) -> list[torch.Tensor]:
    """The device values `settle` needs, for the caller's one read (none before an fp16 launched step)."""
    return [] if optimizer._device_scaler is None else optimizer._device_scaler.state()


def settle(optimizer, values: list[float]) -> int:
    """fp16's launched steps: the host scaler takes `settle_values` as read, the step count drops the steps skipped
    since the last settle, and their number is returned; a TrainingError when the overflows at the minimum scale
    ran to the limit (as the synchronising `step` stops)."""
    if optimizer._device_scaler is None:
        return 0
    skipped, longest = optimizer._device_scaler.settle(values)
    optimizer.masters.step_count -= skipped
    optimizer.unsettled_steps = 0
    if longest >= optimizer.precision.max_skips_at_min_scale:
        raise TrainingError(f"fp16 gradients overflowed at the minimum loss scale {optimizer.scaler.scale:g} for "
                            f"{longest} iterations in a row (read at iteration {optimizer.iteration}): nothing is "
                            f"being learned; train in bf16, lower --lr, or lower --min-loss-scale")
    return skipped


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


def launch_fp16_step(optimizer, lrs: list[float], watch: tuple[torch.Tensor, ...]) -> DeviceStep:
    """fp16's update with no device-to-host read (module docstring); `lrs[k]`: the learning rate if k of the steps
    launched since the last settle were skipped."""
    optimizer._add_tied_gradients()
    scaler = device_scaler(optimizer)
    scale, skipped_before = scaler.scale.clone(), scaler.skipped.clone()
    grads = optimizer._fp32_grads(scaler.inverse())
    cast = isinstance(grads, Fp32Buckets)
    squared = grad_norm_squared(grads.shards if cast else grads, optimizer._norm_runs, optimizer.groups,
                                check_overflow=True, scale=grads.inverse_scale if cast else 1.0)
    found_inf = ~torch.isfinite(squared)  # the norm's all-reduce spans every rank: an overflow anywhere is seen
    if optimizer.zero.check_for_nan_in_grad and watch:  # the loss; a non-finite norm is an overflow, skipped
        bad = torch.zeros((), dtype=torch.bool, device=squared.device)
        for value in watch:
            bad = bad | ~torch.isfinite(value.to(squared.device))
        optimizer._halted = bad if optimizer._halted is None else optimizer._halted | bad
    skip = found_inf if optimizer._halted is None else found_inf | optimizer._halted
    coef = clip_coefficient_on_device(squared, optimizer.config.clip_grad)
    optimizer.masters.step_skippable(grads, lrs, skipped_before, coef, skip)
    if cast:
        grads.release()
        optimizer.step_fp32_peak = max(optimizer.step_fp32_peak, grads.meter.peak)
    optimizer.stage.after_update()
    scaler.update(found_inf)
    return DeviceStep(squared, optimizer._halted, found_inf, scale, skipped_before)
