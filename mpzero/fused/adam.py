"""One AdamW step over flat fp32 tensors (a ZeRO partition), in place, in one pass over memory.

Same formula and bias correction as `torch.optim.AdamW` (single-tensor path), decoupled weight decay:
    p *= 1 - lr * wd;  m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g
    p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
The gradient may be fp32/bf16/fp16 (read as fp32) and is used times `grad_scale` (the clipping coefficient):
the Triton kernel multiplies as it reads, in fp32 as an in-place `mul_` would, so the step needs no pass of its
own over the gradients to clip them; the other implementations scale them first (fp32 ones in place, as
clipping does). The Triton kernel also writes the bf16/fp16 model copy of the new parameters in the same pass.
ZeRO stages 1-3 all call this on their own partition.

With no host synchronisation (issue 46): `grad_scale` may be a 0-dim fp32 device tensor (the clipping coefficient
as the device computed it) and `skip` a 0-dim device flag: when it is set, nothing is written (params, moments,
model copy). The Triton kernel reads both from memory; torch's fused kernel takes the flag as its `found_inf`
(the reference arithmetic has no such path: `skips_on_device`).
"""

from __future__ import annotations

import torch
from torch.optim.adamw import adamw as torch_adamw

from mpzero.errors import ConfigError
from mpzero.fused.impl import KernelSpec, dispatch, jit, launch_device, tl, triton

BLOCK = 1024  # elements per program: 4 fp32 per thread at 8 warps


def adamw_reference(params, grads, exp_avg, exp_avg_sq, model_copy, lr, beta1, beta2, eps, weight_decay,
                    step) -> None:
    """torch.optim.AdamW's single-tensor arithmetic, op for op (so it matches it exactly)."""
    grads = grads.float()
    params.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grads, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grads, grads, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    denom = (exp_avg_sq.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
    params.addcdiv_(exp_avg, denom, value=-step_size)
    if model_copy is not None:
        model_copy.copy_(params)


@jit
def _adamw_kernel(P, G, M, V, Copy, n, grad_scale, decay, w1, beta2, w2, step_size, bc2_sqrt, eps, Scale, Skip,
                  Scalars, HAS_COPY: tl.constexpr, SCALE_IN_MEMORY: tl.constexpr, HAS_SKIP: tl.constexpr,
                  SCALARS_IN_MEMORY: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    if SCALE_IN_MEMORY:  # the device's clipping coefficient (fp32), not a launch argument
        grad_scale = tl.load(Scale)
    if SCALARS_IN_MEMORY:  # fp16's launched step: the row of (decay, step_size, bc2_sqrt) the device picked
        decay, step_size, bc2_sqrt = tl.load(Scalars), tl.load(Scalars + 1), tl.load(Scalars + 2)
    if HAS_SKIP:  # a set flag: the step writes nothing
        ok = ok & (tl.load(Skip) == 0)
    p = tl.load(P + offs, mask=ok, other=0.0)
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32) * grad_scale  # exact at 1.0
    m = tl.load(M + offs, mask=ok, other=0.0)
    v = tl.load(V + offs, mask=ok, other=0.0)
    p = p * decay
    # torch's lerp: start + w * (end - start) for w < 0.5, else end - (end - start) * (1 - w)
    m = tl.where(w1 < 0.5, m + w1 * (g - m), g - (g - m) * (1.0 - w1))
    v = v * beta2 + w2 * (g * g)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps  # IEEE sqrt/div, as torch's kernels
    p = p - step_size * tl.div_rn(m, denom)
    tl.store(P + offs, p, mask=ok)
    tl.store(M + offs, m, mask=ok)
    tl.store(V + offs, v, mask=ok)
    if HAS_COPY:
        tl.store(Copy + offs, p.to(Copy.dtype.element_ty), mask=ok)


def _triton_adamw(params, grads, exp_avg, exp_avg_sq, model_copy, lr, beta1, beta2, eps, weight_decay,
                  step, grad_scale, skip=None, in_memory_scalars=None) -> None:
    """`in_memory_scalars`: fp16's launched step (adam_scalars.py), an fp32 device tensor of (decay, step_size,
    bc2_sqrt) read in place of those launch arguments (lr, weight_decay and step are then unused)."""
    # Host scalars computed as adamw_reference computes them (Python doubles), rounded to fp32 at launch.
    scalars = (1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, lr / (1 - beta1 ** step),
               (1 - beta2 ** step) ** 0.5, eps)
    n = params.numel()
    copy_arg = params if model_copy is None else model_copy  # never written when HAS_COPY is False
    in_memory = isinstance(grad_scale, torch.Tensor) or skip is not None  # both in memory or neither: one variant
    if in_memory and not isinstance(grad_scale, torch.Tensor):  # a fill on the device, no host-to-device copy
        grad_scale = torch.full((), grad_scale, dtype=torch.float32, device=params.device)
    if in_memory and skip is None:
        skip = torch.zeros((), dtype=torch.bool, device=params.device)
    scale_arg, host_scale = (grad_scale, 1.0) if in_memory else (params, grad_scale)  # unread where not flagged
    with launch_device(params):
        _adamw_kernel[(triton.cdiv(n, BLOCK),)](params, grads, exp_avg, exp_avg_sq, copy_arg, n, host_scale, *scalars,
                                                scale_arg, params if skip is None else skip,
                                                params if in_memory_scalars is None else in_memory_scalars,
                                                HAS_COPY=model_copy is not None, SCALE_IN_MEMORY=in_memory,
                                                HAS_SKIP=in_memory, SCALARS_IN_MEMORY=in_memory_scalars is not None,
                                                BLOCK=BLOCK, num_warps=8)


def _torch_fused_adamw(params, grads, exp_avg, exp_avg_sq, model_copy, lr, beta1, beta2, eps, weight_decay,
                       step, skip=None) -> None:
    """torch's own fused AdamW kernel (CPU and CUDA); it needs fp32 gradients like the parameters. `skip`: its
    found_inf (a set flag leaves everything as it was)."""
    # The fused kernel increments its step tensor (fp32, on the parameters' device) before using it. A fill, not
    # torch.tensor(..., device=cuda): that copies from pageable host memory and waits for the stream.
    steps = [torch.full((), float(step - 1), dtype=torch.float32, device=params.device)]
    found_inf = None if skip is None else skip.to(torch.float32)
    torch_adamw([params], [grads.float()], [exp_avg], [exp_avg_sq], [], steps, fused=True, amsgrad=False,
                beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=False,
                found_inf=found_inf)
    if model_copy is not None:  # a skipped step rewrites the copy from the unchanged masters: the same values
        model_copy.copy_(params)


def _check_inputs(params, grads, exp_avg, exp_avg_sq, model_copy, step) -> None:
    n = params.numel()
    for name, t in (("grads", grads), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("model_copy", model_copy)):
        if t is not None and t.device != params.device:  # a kernel would read a foreign pointer
            raise ConfigError(f"adamw_step: {name} is on {t.device} but params on {params.device}: keep a "
                              f"partition's tensors on one device")
    for name, t in (("params", params), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32 or t.dim() != 1 or t.numel() != n or not t.is_contiguous():
            raise ConfigError(f"adamw_step: {name} must be a flat contiguous fp32 tensor of {n} elements, "
                              f"got {t.dtype} {tuple(t.shape)}")
    allowed = (torch.float32, torch.bfloat16, torch.float16)
    for name, t in (("grads", grads), ("model_copy", model_copy)):
        if t is not None and (t.dtype not in allowed or t.shape != params.shape or not t.is_contiguous()):
            raise ConfigError(f"adamw_step: {name} must be a flat contiguous fp32/bf16/fp16 tensor like params, "
                              f"got {t.dtype} {tuple(t.shape)}")
    if step < 1:
        raise ConfigError(f"adamw_step: step counts from 1 (torch's convention), got {step}")


ADAMW_DEVICE_SKIP_IMPLS = ("triton", "torch_fused")  # the implementations that take `skip` (and a device `grad_scale`)


def adamw_step(params: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
               model_copy: torch.Tensor | None = None, impl: str = "auto", grad_scale: float | torch.Tensor = 1.0,
               skip: torch.Tensor | None = None) -> None:
    """AdamW step `step` (from 1) in place on a flat fp32 partition with the gradients times `grad_scale` (a float,
    or a 0-dim fp32 tensor on the partition's device); optionally writes `model_copy`. `skip`: a 0-dim device
    flag; when set, nothing is written (implementations `ADAMW_DEVICE_SKIP_IMPLS`)."""
    _check_inputs(params, grads, exp_avg, exp_avg_sq, model_copy, step)
    fn = dispatch("adamw_step", params.device, impl,
                  {"torch": adamw_reference, "triton": _triton_adamw, "torch_fused": _torch_fused_adamw})
    if skip is not None and fn not in (_triton_adamw, _torch_fused_adamw):
        raise ConfigError(f"adamw_step: impl {impl!r} cannot skip on a device flag: use one of "
                          f"{ADAMW_DEVICE_SKIP_IMPLS}")
    skipping = {} if skip is None else {"skip": skip}
    if fn is _triton_adamw:
        fn(params, grads, exp_avg, exp_avg_sq, model_copy, lr, beta1, beta2, eps, weight_decay, step, grad_scale,
           **skipping)
        return
    if isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0:
        grads = grads.float().mul_(grad_scale)  # fp32 gradients in place, as clipping does
    fn(params, grads, exp_avg, exp_avg_sq, model_copy, lr, beta1, beta2, eps, weight_decay, step, **skipping)


def triton_kernel_specs() -> list[KernelSpec]:
    """Compile-only variants: fp32 master weights with each gradient dtype and model-copy dtype."""
    floats = {n: "fp32" for n in ("decay", "w1", "beta2", "w2", "step_size", "bc2_sqrt", "eps")}
    specs = []
    variants = [(g, c, False) for g, c in (("fp32", None), ("fp32", "bf16"), ("fp32", "fp16"), ("bf16", "bf16"),
                                           ("fp16", "fp16"))]
    variants += [("fp32", None, True), ("fp32", "bf16", True)]  # the launched step's: the coefficient in memory
    variants += [("fp32", "fp16", "fp16")]  # fp16's launched step: its decay, step size and bias correction too
    for grad_dt, copy_dt, on_device in variants:
        types = {"P": "*fp32", "G": f"*{grad_dt}", "M": "*fp32", "V": "*fp32", "Copy": f"*{copy_dt or 'fp32'}",
                 "n": "i32", "grad_scale": "fp32", **floats, "Scale": "*fp32",
                 "Skip": "*i1" if on_device else "*fp32", "Scalars": "*fp32"}
        suffix = {False: "", True: "_on_device", "fp16": "_fp16_on_device"}[on_device]
        specs.append(KernelSpec(f"adamw_grad_{grad_dt}_copy_{copy_dt or 'none'}{suffix}", _adamw_kernel, types,
                                {"HAS_COPY": copy_dt is not None, "SCALE_IN_MEMORY": bool(on_device),
                                 "HAS_SKIP": bool(on_device), "SCALARS_IN_MEMORY": on_device == "fp16",
                                 "BLOCK": BLOCK}, 8))
    return specs
