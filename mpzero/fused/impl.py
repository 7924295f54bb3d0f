"""Which implementation runs a fused op, chosen explicitly: never a silent fallback.

Each op has a plain PyTorch reference ("torch"), the same reference under `torch.compile` ("compile"),
a Triton kernel ("triton"; CUDA tensors, or CPU tensors under Triton's interpreter) and, for AdamW,
torch's own fused AdamW ("torch_fused"). `auto` resolves from the device alone, to the implementation measured
fastest on that device: `CPU_CHOICE` by bench/bench_fused_cpu.py, `CUDA_CHOICE` by bench/bench_fused_gpu.py on
an H100 (`make gpu-check`; figures in bench/README.md, "On one H100", and its history). Resolution is a pure function of
(op, device, installed triton), so callers resolve once at start and log `resolved_impls(device)`. Asking for
something that cannot run raises `ConfigError`.

The attention backend (`--attention-backend`, Megatron-core's names) is chosen the same way, from the device and
whether the attention has dropout: `resolve_attention_backend(backend, device, dropout=p)`.

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
    "rms_norm": ("torch", "compile", "triton"),
    "scaled_masked_softmax": ("torch", "compile", "triton"),
    "adamw_step": ("torch", "compile", "torch_fused", "triton"),
    "cross_entropy": ("torch", "compile"),  # the chunked loss's arithmetic (mpzero.fused.cross_entropy)
    "sum_of_squares": ("torch", "triton"),  # the global gradient norm's fp64 reduction (mpzero.zero.norm)
}

# The CPU winner per op, measured by bench/bench_fused_cpu.py (see bench/README.md for the numbers).
# cross_entropy: the reference. At GPT-2's loss (8192 tokens, chunks of 2048, V 50304, 2 threads) the compiled
# arithmetic ties it in fp32 (14.44 against 14.66 s, 16.49 against 16.27) and wins 11-18% in bf16 (7.57 against 8.49
# s, 9.08 against 11.11; bench/bench_cross_entropy.py, 2026-11-26): not worth the seconds of compilation every
# process pays per chunk shape.
# sum_of_squares: the reference (the kernel runs on a CPU only under Triton's interpreter).
CPU_CHOICE = {"layer_norm": "torch", "rms_norm": "torch", "scaled_masked_softmax": "torch", "adamw_step": "torch_fused",
              "cross_entropy": "torch", "sum_of_squares": "torch"}
# The CUDA winner per op at GPT-2 shapes, measured on an H100 by bench/bench_fused_gpu.py (triton.testing.do_bench
# medians, bench/README.md at 5a79686, "On one H100", 2026-11-22):
# - layer_norm: torch's F.layer_norm, 0.201 ms fwd+bwd at [8192, 768] bf16 against 0.582 for the Triton kernel
#   (and 0.581 compiled): the kernel held one row per program with a serial dweight/dbias pass, 2.9x slower.
#   With its dweight/dbias partials spread over the SMs (2026-11-27, H100): torch 0.221, the kernel 0.338,
#   compiled 0.536; torch's still wins;
# - scaled_masked_softmax: the Triton kernel, 0.584 ms at [1, 96, 1024, 1024] bf16 against torch's 5.239 (9.0x);
# - adamw_step: the Triton kernel, 1.253 ms over 124M fp32 masters + bf16 copy against torch's fused 1.644.
# - rms_norm: torch's reference, by analogy with layer_norm first (the kernel has the same one-row, serial-dweight
#   design that lost 2.9x there).
#   Measured 2026-11-26 (H100, bench/bench_fused_gpu.py): torch 0.459 ms at [8192, 768] bf16, compiled 0.361, the
#   kernel 0.605. The compiled norm stays out of `auto`: the activation formula models the torch and Triton norms'
#   saved tensors, not what a compiler keeps. 2026-11-27 (H100): torch 0.472, compiled 0.683, the kernel 0.428
#   (1.10x, one run): torch's stays until a LLaMA step under --torch-compile is measured with the kernel.
# - cross_entropy: compiled (--cross-entropy-loss-fusion's arithmetic): the output projection + loss of GPT-2's 8192
#   tokens in chunks of 2048, fwd+bwd bf16, 5.15 ms against the reference's 14.81 (2.9x), and a GPT-2 124M step
#   (gpu-check's bench_gpt2, with --torch-compile) 35.5 ms against 38.8 (H100, 2026-11-26).
# - sum_of_squares: the Triton kernel, from the H100 profile of mpzero's GPT-2 step (bench_gpt2's log, 2026-11-26):
#   the reference's fp64 casts were 31 launches and 0.63 ms of the step, beside as many dot products and adds, ~90
#   launches for 124M gradients; the kernel makes 2 per run and reads 4 bytes per fp32 element where the reference
#   moves 20. Its own time (bench_fused_gpu.py's `sum_of_squares` row, H100, 2026-11-27): 0.181 ms over 124M fp32
#   gradients against the reference's 1.351 (7.5x).
CUDA_CHOICE = {"layer_norm": "torch", "rms_norm": "torch", "scaled_masked_softmax": "triton", "adamw_step": "triton",
               "cross_entropy": "compile", "sum_of_squares": "triton"}

# --attention-backend, with Megatron-core's names and their meaning here:
# - flash: torch's F.scaled_dot_product_attention, whose dispatcher picks FlashAttention-2, cuDNN or the
#   memory-efficient kernel on CUDA (one fused kernel on CPU); [s, s] is never materialized;
# - fused: the same call restricted to cuDNN's fused attention (Megatron-core's "fused" is cuDNN's, through
#   Transformer Engine); CUDA only;
# - local: Megatron's own core attention: explicit [s, s] scores, the fused scale + causal mask + softmax op
#   (`scaled_masked_softmax`, Triton on CUDA), dropout, the matmul with the values;
# - unfused: the same explicit path with the PyTorch reference softmax (Transformer Engine's unfused attention);
# - auto: flash on CUDA (GPT-2 124M bf16 on an H100: 53.3 ms per step against 61.2 for local, bench/README.md at
#   5a79686).
#   On a CPU, flash without attention dropout (LLaMA's setting, examples/llama_tiny.yaml): SDPA's CPU flash kernel,
#   whose logsumexp the activation formula counts, at 464-470 ms per LLaMA step against local's 591 (bench/
#   bench_llama.py, h 256, 4 layers, seq 256, batch 8, 2 threads, 2026-11-25: 1.05x and 1.34x eager PyTorch) and
#   5,204 GPT-2 tokens/s against 4,146 (bench/bench_step.py); local with attention dropout (Megatron's and GPT-2's
#   default 0.1), which sends CPU SDPA to its math fallback: explicit [s, s] scores and masks the formula does not
#   model.
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
ATTENTION_CHOICE = {"cuda": "flash", "cpu": "flash"}  # auto without attention dropout
ATTENTION_CHOICE_WITH_DROPOUT = {"cuda": "flash", "cpu": "local"}


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
    impl = planned_impl(op, device, impl)
    if impl == "triton":
        _check_triton_runs(op, device)
    return impl


def planned_impl(op: str, device: torch.device | str, impl: str = "auto") -> str:
    """What `auto` means for `op` on a device of `device`'s type, without requiring it runnable here (a CPU
    machine plans a CUDA run)."""
    if impl != "auto":
        return impl
    return (CUDA_CHOICE if torch.device(device).type == "cuda" else CPU_CHOICE)[op]


def planned_device_type(device: torch.device | str) -> str:
    """The device type whose kernels `device` stands for: the dry run's meta tensors stand for a CPU run
    (`mpzero.planner.fake`), as its fake tensors (device cpu) do; any other device for itself."""
    device_type = torch.device(device).type
    return "cpu" if device_type == "meta" else device_type


def planned_attention_backend(backend: str, device: torch.device | str, *, dropout: float) -> str:
    """What `backend` means on a device of `device`'s type for attention with `dropout` (one of flash, fused,
    unfused, local), without requiring it runnable there (a CPU machine plans a CUDA run)."""
    if backend not in ATTENTION_BACKENDS:
        raise ConfigError(f"--attention-backend {backend} is not one of {', '.join(ATTENTION_BACKENDS)}")
    if backend != "auto":
        return backend
    return (ATTENTION_CHOICE_WITH_DROPOUT if dropout > 0 else ATTENTION_CHOICE).get(planned_device_type(device),
                                                                                    "local")


def resolve_attention_backend(backend: str, device: torch.device | str, *, dropout: float) -> str:
    """The attention backend `backend` runs on `device` for attention with `dropout`: one of flash, fused,
    unfused, local."""
    resolved = planned_attention_backend(backend, device, dropout=dropout)
    device_type = torch.device(device).type
    if resolved == "fused" and device_type != "cuda":
        raise ConfigError(f"--attention-backend fused is cuDNN's fused attention and needs CUDA (this run is on "
                          f"{device_type}): use flash (torch's scaled_dot_product_attention) or local")
    return resolved


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
