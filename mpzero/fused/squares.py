"""The sum of squares of a flat gradient, accumulated in fp64: the global norm's reduction (mpzero.zero.norm).

The reference casts CHUNK elements at a time to fp64 and takes their dot product. Each chunk needs a 32 MiB fp64
temporary and three launches (cast, dot, add). Over GPT-2 124M's gradients that is 30 chunks, ~90 launches, and
20 bytes of memory traffic per element: read 4, write 8 for the copy, read 8 back.
The Triton kernel reads each element once, in its own dtype, and squares and sums in fp64 registers. It writes
one partial sum per program, and a torch sum of those (fixed order: the same result on every call) finishes
it: two launches per tensor, 4 bytes per fp32 element.
Both square the same values (the element cast to fp32, times `scale` when that is not 1, then cast to fp64; fp64
holds every fp32 square exactly), so the sums differ only in the order of fp64 additions (~1e-16 relative).
"""

from __future__ import annotations

import torch

from mpzero.fused.impl import KernelSpec, dispatch, jit, launch_device, tl, triton

CHUNK = 1 << 22  # elements per fp64 pass of the reference: a 32 MiB temporary, whatever the tensor's size
BLOCK = 4096  # elements per program of the kernel: 4 per thread at 8 warps, 30K partial sums for 124M elements


def sum_of_squares_reference(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """sum((scale x)**2) of a 1-D tensor as an fp64 scalar on x's device, accumulated in fp64 chunk by chunk;
    `scale` applies to the chunk cast to fp32 (the values the step's fp32 gradients will hold)."""
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for start in range(0, x.numel(), CHUNK):
        chunk = x[start:start + CHUNK]
        if scale != 1.0:  # on a copy: fp32 gradients keep their values
            chunk = chunk.to(torch.float32, copy=True).mul_(scale)
        chunk = chunk.to(torch.float64)  # exact from fp32, bf16 and fp16
        total += torch.dot(chunk, chunk)
    return total


@jit
def _sum_of_squares_kernel(X, Partial, n, scale, SCALED: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
    if SCALED:
        x = x * scale  # an fp32 product, as the reference's mul_ of the fp32 copy
    x = x.to(tl.float64)
    tl.store(Partial + pid, tl.sum(x * x, axis=0))


def _triton_sum_of_squares(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    n = x.numel()
    partial = torch.empty(triton.cdiv(n, BLOCK), dtype=torch.float64, device=x.device)
    if n:
        with launch_device(x):
            _sum_of_squares_kernel[(partial.numel(),)](x, partial, n, scale, SCALED=scale != 1.0, BLOCK=BLOCK,
                                                      num_warps=8)
    return partial.sum()


def working_bytes(numel: int, impl: str, scaled: bool) -> int:
    """Device bytes the sum of squares of `numel` elements allocates beside its input, by implementation: the
    reference's fp64 chunk (and, `scaled`, the fp32 copy it unscales first), the kernel's fp64 partial sums."""
    if impl == "triton":
        return 8 * -(-numel // BLOCK)
    return (12 if scaled else 8) * min(CHUNK, numel)


def sum_of_squares(x: torch.Tensor, scale: float = 1.0, impl: str = "auto") -> torch.Tensor:
    """sum((scale x)**2) of a contiguous 1-D tensor (fp32, bf16 or fp16) as an fp64 scalar on x's device."""
    if x.dim() != 1 or not x.is_contiguous():
        raise ValueError(f"sum_of_squares takes a contiguous 1-D tensor, got shape {tuple(x.shape)}")
    fn = dispatch("sum_of_squares", x.device, impl,
                  {"torch": sum_of_squares_reference, "triton": _triton_sum_of_squares})
    return fn(x, scale)


def triton_kernel_specs() -> list[KernelSpec]:
    """Compile-only variants: each gradient dtype, unscaled and loss-scaled."""
    return [KernelSpec(f"sum_of_squares_{dt}{'_scaled' if scaled else ''}", _sum_of_squares_kernel,
                       {"X": f"*{dt}", "Partial": "*fp64", "n": "i32", "scale": "fp32"},
                       {"SCALED": scaled, "BLOCK": BLOCK}, 8)
            for dt in ("fp32", "bf16", "fp16") for scaled in (False, True)]
