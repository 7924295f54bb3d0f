"""Compile every fused kernel variant to PTX and cubin for real NVIDIA targets, without a GPU (`compile_spec`
over `all_kernel_specs()`); the command is `tools/compile_kernels.py`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mpzero.fused.adam import triton_kernel_specs as adam_specs
from mpzero.fused.layer_norm import triton_kernel_specs as layer_norm_specs
from mpzero.fused.rms_norm import triton_kernel_specs as rms_norm_specs
from mpzero.fused.softmax import triton_kernel_specs as softmax_specs
from mpzero.fused.squares import triton_kernel_specs as sum_of_squares_specs
from mpzero.fused.impl import KernelSpec, triton


@dataclass(frozen=True)
class CompileResult:
    name: str
    capability: int
    ptx_bytes: int
    cubin_bytes: int
    seconds: float


def all_kernel_specs() -> list[KernelSpec]:
    return layer_norm_specs() + rms_norm_specs() + softmax_specs() + adam_specs() + sum_of_squares_specs()


def compile_spec(spec: KernelSpec, capability: int) -> CompileResult:
    """triton.compile for CUDA compute capability `capability` (e.g. 90 = sm_90); raises on failure."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    start = time.perf_counter()
    source = ASTSource(fn=spec.kernel, signature=spec.signature(), constexprs=spec.constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": spec.num_warps})
    ptx, cubin = compiled.asm["ptx"], compiled.asm["cubin"]
    if f".target sm_{capability}" not in ptx or not cubin:
        raise RuntimeError(f"{spec.name}: no sm_{capability} PTX/cubin produced")
    return CompileResult(spec.name, capability, len(ptx), len(cubin), time.perf_counter() - start)
