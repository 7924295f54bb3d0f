"""Which implementation runs a fused op, chosen explicitly: never a silent fallback.

Each op has a plain PyTorch reference ("torch"), the same reference under `torch.compile` ("compile"),
a Triton kernel ("triton"; CUDA tensors, or CPU tensors under Triton's interpreter) and, for AdamW,
torch's own fused AdamW ("torch_fused"). `auto` resolves from the device alone: Triton on CUDA, and on
CPU the implementation measured fastest by bench/bench_fused_cpu.py (figures in bench/README.md).
Resolution is a pure function of (op, device, installed triton), so callers resolve once at start and
log `resolved_impls(device)`. Asking for something that cannot run raises `ConfigError`.

Triton is an optional extra (`pip install mpzero[triton]`); without it the kernel modules still import
(the kernels stay plain functions that nothing launches) and `impl="triton"` raises.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Callable

import torch

from mpzero.errors import ConfigError

try:
    import triton
    import triton.language as tl
except ImportError:  # the optional `triton` extra is not installed
    triton = None
    tl = None

# Triton reads TRITON_INTERPRET when it decorates a kernel, its own library included: set it before triton
# is first imported (torch.optim and torch.compile import it) to run kernels on CPU tensors.
INTERPRETED = triton is not None and bool(triton.knobs.runtime.interpret)

IMPLS = {
    "layer_norm": ("torch", "compile", "triton"),
    "scaled_masked_softmax": ("torch", "compile", "triton"),
    "adamw_step": ("torch", "compile", "torch_fused", "triton"),
}

# The CPU winner per op, measured by bench/bench_fused_cpu.py (see bench/README.md for the numbers).
CPU_CHOICE = {"layer_norm": "torch", "scaled_masked_softmax": "torch", "adamw_step": "torch_fused"}


def jit(fn):
    """`triton.jit` when triton is installed; otherwise the plain function (never launched)."""
    return triton.jit(fn) if triton is not None else fn


def triton_available() -> bool:
    return triton is not None


def resolve_impl(op: str, device: torch.device | str, impl: str = "auto") -> str:
    """The implementation `op` runs on `device` for the requested `impl`; raises if it cannot run."""
    if op not in IMPLS:
        raise ConfigError(f"unknown fused op {op!r}: expected one of {sorted(IMPLS)}")
    if impl != "auto" and impl not in IMPLS[op]:
        raise ConfigError(f"unknown impl {impl!r} for {op}: expected 'auto' or one of {IMPLS[op]}")
    device = torch.device(device)
    if impl == "auto":
        impl = "triton" if device.type == "cuda" else CPU_CHOICE[op]
    if impl == "triton":
        _check_triton_runs(op, device)
    return impl


def resolved_impls(device: torch.device | str) -> dict[str, str]:
    """{op: implementation} that `auto` picks on `device`: what a training run logs at start."""
    return {op: resolve_impl(op, device) for op in IMPLS}


def _check_triton_runs(op: str, device: torch.device) -> None:
    if triton is None:
        raise ConfigError(f"{op}: impl 'triton' needs the triton package: pip install 'mpzero[triton]', "
                          f"or choose impl 'torch' (the --no-*-fusion flags)")
    if device.type != "cuda" and not INTERPRETED:
        raise ConfigError(f"{op}: impl 'triton' needs CUDA tensors (got {device.type}), or "
                          f"TRITON_INTERPRET=1 set before mpzero.fused is imported; choose impl 'torch' on CPU")


def dispatch(op: str, device: torch.device, impl: str, choices: dict[str, Callable]) -> Callable:
    """The callable for the resolved implementation of `op` on `device`; "compile" compiles choices["torch"]."""
    name = resolve_impl(op, device, impl)
    return compiled(choices["torch"]) if name == "compile" else choices[name]


def launch_device(tensor: torch.Tensor):
    """Context for a Triton launch on `tensor`: Triton launches on the *current* CUDA device and its
    stream, so a tensor on another GPU (cuda:1 while cuda:0 is current) is made current for the launch."""
    if tensor.is_cuda:
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


@functools.cache
def compiled(fn: Callable) -> Callable:
    """`torch.compile(fn)`, built once per function (compilation itself happens on first call)."""
    return torch.compile(fn)


def row_block(width: int, max_width: int, op: str) -> tuple[int, int, int]:
    """(BLOCK_M rows, BLOCK_N columns, num_warps) for a row-wise kernel that holds whole rows.

    Several rows per program keep small widths efficient on a GPU and cut program count under the
    interpreter (~2 ms per program); the tile stays at or under 4096 elements unless one row is wider.
    """
    if width > max_width:
        raise ConfigError(f"{op}: last dimension {width} exceeds the Triton kernel's limit {max_width}; "
                          f"use impl 'torch' for wider rows")
    block_n = triton.next_power_of_2(max(width, 1))
    block_m = max(1, min(16, 4096 // block_n))
    num_warps = min(16, max(4, block_m * block_n // 1024))
    return block_m, block_n, num_warps


@dataclass(frozen=True)
class KernelSpec:
    """One compile-only variant of a kernel: argument types, constexpr values and launch warps.

    `signature()` lists every kernel argument in order, so a kernel whose arguments change without its
    spec fails the compile test instead of compiling a stale variant.
    """

    name: str
    kernel: object
    types: dict[str, str]
    constexprs: dict[str, object] = field(default_factory=dict)
    num_warps: int = 4

    def signature(self) -> dict[str, str]:
        names = self.kernel.arg_names
        missing = [n for n in names if n not in self.types and n not in self.constexprs]
        if missing or len(names) != len(self.types) + len(self.constexprs):
            raise ValueError(f"{self.name}: spec does not match the kernel arguments {names}")
        return {n: ("constexpr" if n in self.constexprs else self.types[n]) for n in names}
