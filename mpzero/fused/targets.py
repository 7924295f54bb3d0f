"""Compile every fused kernel variant to PTX and cubin for real NVIDIA targets, without a GPU.

Run: `python -m mpzero.fused.targets [CC ...]` (default 80 90), WITHOUT TRITON_INTERPRET (an interpreted
kernel cannot be compiled); point TRITON_CACHE_DIR at a fresh directory to force real compilation.
Prints one line per kernel variant and target and exits non-zero if any failed.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from mpzero.cli import run_or_exit
from mpzero.errors import ConfigError
from mpzero.fused.adam import triton_kernel_specs as adam_specs
from mpzero.fused.layer_norm import triton_kernel_specs as layer_norm_specs
from mpzero.fused.rms_norm import triton_kernel_specs as rms_norm_specs
from mpzero.fused.softmax import triton_kernel_specs as softmax_specs
from mpzero.fused.impl import INTERPRETED, KernelSpec, triton


@dataclass(frozen=True)
class CompileResult:
    name: str
    capability: int
    ptx_bytes: int
    cubin_bytes: int
    seconds: float


def all_kernel_specs() -> list[KernelSpec]:
    return layer_norm_specs() + rms_norm_specs() + softmax_specs() + adam_specs()


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


def main(argv: list[str]) -> int:
    if triton is None or INTERPRETED:
        raise ConfigError("mpzero.fused.targets needs triton installed and TRITON_INTERPRET unset")
    capabilities = [int(a) for a in argv] or [80, 90]
    failed = 0
    for spec in all_kernel_specs():
        for cc in capabilities:
            try:
                r = compile_spec(spec, cc)
                print(f"ok   {r.name:28s} sm_{cc}  ptx {r.ptx_bytes:7d} B  cubin {r.cubin_bytes:7d} B  {r.seconds:5.2f} s")
            except Exception as exc:  # report every variant, then fail
                failed += 1
                print(f"FAIL {spec.name:28s} sm_{cc}  {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_or_exit(lambda: main(sys.argv[1:])))
