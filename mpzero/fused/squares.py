"""The sum of squares of a flat gradient, accumulated in fp64: the global norm's reduction (mpzero.zero.norm).

The reference casts a chunk of elements at a time to fp64, into one buffer reused for every chunk, and takes their
dot product. On a GPU a chunk is CHUNK elements (a 32 MiB buffer) and costs three launches (cast, dot, add): over
GPT-2 124M's gradients 30 chunks, ~90 launches, and 20 bytes of memory traffic per element: read 4, write 8 for the
copy, read 8 back. On a CPU a chunk is CPU_CHUNK elements, a buffer that stays in cache: the copy is written and
read back there, not in memory, and one buffer is allocated per call (a fresh 32 MiB copy per chunk is mapped anew
by the allocator and its pages faulted in: 10x the time of the whole sum at 5.3M fp32 gradients, issue 47).
The Triton kernel reads each element once, in its own dtype, and squares and sums in fp64 registers. It writes
one partial sum per program, and a torch sum of those (fixed order: the same result on every call) finishes
it: two launches per tensor, 4 bytes per fp32 element.
Both square the same values (the element cast to fp32, times `scale` when that is not 1, then cast to fp64; fp64
holds every fp32 square exactly), so the sums differ only in the order of fp64 additions (~1e-16 relative).
"""

from __future__ import annotations

import torch

from mpzero.fused.impl import KernelSpec, dispatch, jit, launch_device, tl, triton

CHUNK = 1 << 22  # elements per fp64 pass of the reference on a GPU: a 32 MiB buffer, whatever the tensor's size
CPU_CHUNK = 1 << 18  # on a CPU: a 2 MiB buffer (bench/bench_norm.py --cpu-chunks: 2^17-2^20 within noise, 2^14-2^16
# up to 2x slower, each chunk's three ops then cost more than its copy saves)
BLOCK = 4096  # elements per program of the kernel: 4 per thread at 8 warps, 30K partial sums for 124M elements


def sum_of_squares_reference(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """sum((scale x)**2) of a 1-D tensor as an fp64 scalar on x's device, accumulated in fp64 chunk by chunk;
    `scale` applies to the chunk cast to fp32 (the values the step's fp32 gradients will hold)."""
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    size = min(chunk_elements(x.device), x.numel())
    wide = torch.empty(size, dtype=torch.float64, device=x.device)
    scaled = isinstance(scale, torch.Tensor) or scale != 1.0  # a tensor: a 0-dim device scale, not read
    narrow = torch.empty(size if scaled else 0, dtype=torch.float32, device=x.device)
    for start in range(0, x.numel(), max(size, 1)):
        chunk = x[start:start + size]
        if scaled:  # on a copy: fp32 gradients keep their values
            chunk = narrow[:chunk.numel()].copy_(chunk).mul_(scale)
        chunk = wide[:chunk.numel()].copy_(chunk)  # exact from fp32, bf16 and fp16
        total += torch.dot(chunk, chunk)
    return total


def chunk_elements(device: torch.device) -> int:
    """Elements the reference casts to fp64 at a time on `device`."""
    return CPU_CHUNK if torch.device(device).type == "cpu" else CHUNK


@jit
def _sum_of_squares_kernel(X, Partial, n, scale, Scale, SCALED: tl.constexpr, SCALE_IN_MEMORY: tl.constexpr,
                           BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
    if SCALE_IN_MEMORY:  # fp16's device loss scale (issue 46), rounded to fp32 as a launch rounds the float
        scale = tl.load(Scale)
    if SCALED:
        x = x * scale  # an fp32 product, as the reference's mul_ of the fp32 copy
    x = x.to(tl.float64)
    tl.store(Partial + pid, tl.sum(x * x, axis=0))


def _triton_sum_of_squares(x: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    n = x.numel()
    partial = torch.empty(triton.cdiv(n, BLOCK), dtype=torch.float64, device=x.device)
    in_memory = isinstance(scale, torch.Tensor)
    if n:
        with launch_device(x):
            _sum_of_squares_kernel[(partial.numel(),)](x, partial, n, 1.0 if in_memory else scale,
                                                      scale.float() if in_memory else partial,
                                                      SCALED=in_memory or scale != 1.0, SCALE_IN_MEMORY=in_memory,
                                                      BLOCK=BLOCK, num_warps=8)
    return partial.sum()


def working_bytes(numel: int, impl: str, scaled: bool, device: str = "cuda") -> int:
    """Bytes the sum of squares of `numel` elements allocates on a `device` beside its input, by implementation:
    the reference's fp64 chunk (and, `scaled`, the fp32 copy it unscales first), the kernel's fp64 partial sums."""
    if impl == "triton":
        return 8 * -(-numel // BLOCK)
    return (12 if scaled else 8) * min(chunk_elements(device), numel)


def sum_of_squares(x: torch.Tensor, scale: float | torch.Tensor = 1.0, impl: str = "auto") -> torch.Tensor:
    """sum((scale x)**2) of a contiguous 1-D tensor (fp32, bf16 or fp16) as an fp64 scalar on x's device."""
    if x.dim() != 1 or not x.is_contiguous():
        raise ValueError(f"sum_of_squares takes a contiguous 1-D tensor, got shape {tuple(x.shape)}")
    fn = dispatch("sum_of_squares", x.device, impl,
                  {"torch": sum_of_squares_reference, "triton": _triton_sum_of_squares})
    return fn(x, scale)


def triton_kernel_specs() -> list[KernelSpec]:
    """Compile-only variants: each gradient dtype, unscaled and loss-scaled."""
    return [KernelSpec(f"sum_of_squares_{dt}{'_scaled' if scaled else ''}{'_in_memory' if in_memory else ''}",
                       _sum_of_squares_kernel, {"X": f"*{dt}", "Partial": "*fp64", "n": "i32", "scale": "fp32",
                                                "Scale": "*fp32" if in_memory else "*fp64"},
                       {"SCALED": scaled, "SCALE_IN_MEMORY": in_memory, "BLOCK": BLOCK}, 8)
            for dt in ("fp32", "bf16", "fp16") for scaled, in_memory in ((False, False), (True, False), (True, True))]
