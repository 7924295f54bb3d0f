"""Time each fused op's CPU implementations against eager PyTorch in the same run; print the ratios.

Run: `PYTHONPATH=. python bench/bench_fused_cpu.py [--reps 20] [--threads 2] [--small]`

Eager = the op's plain PyTorch reference ("torch"); also "compile" (torch.compile of that reference,
compile time excluded and reported apart) and, for AdamW, "torch_fused" (torch's fused AdamW kernel).
LayerNorm and softmax are timed forward + backward; AdamW one in-place step. The `auto` choice on CPU
(`mpzero.fused.impl.CPU_CHOICE`) is set from these numbers; see bench/README.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mpzero.fused import adamw_step, layer_norm, scaled_masked_softmax
from mpzero.fused.impl import IMPLS


def _interleaved_medians_ms(runs: dict, reps: int) -> dict:
    """Median ms per implementation, timed round-robin so the load of a shared machine hits all alike."""
    times = {impl: [] for impl in runs}
    for _ in range(reps):
        for impl, run in runs.items():
            start = time.perf_counter()
            run()
            times[impl].append((time.perf_counter() - start) * 1e3)
    return {impl: statistics.median(t) for impl, t in times.items()}


def _layer_norm_case(impl: str, tokens: int, hidden: int):
    x = torch.randn(tokens, hidden, requires_grad=True)
    w, b = torch.randn(hidden, requires_grad=True), torch.randn(hidden, requires_grad=True)
    dy = torch.randn(tokens, hidden)
    return lambda: layer_norm(x, w, b, 1e-5, impl=impl).backward(dy)


def _softmax_case(impl: str, heads: int, seq: int):
    scores = torch.randn(1, heads, seq, seq, requires_grad=True)
    dy = torch.randn(1, heads, seq, seq)
    return lambda: scaled_masked_softmax(scores, 0.125, True, None, impl=impl).backward(dy)


def _adamw_case(impl: str, numel: int):
    params, grads = torch.randn(numel), torch.randn(numel)
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    step = iter(range(1, 10**6))
    return lambda: adamw_step(params, grads, exp_avg, exp_avg_sq, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8,
                              weight_decay=0.1, step=next(step), impl=impl)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="tiny sizes, to check the script runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    k = 8 if args.small else 1
    cases = {
        "layer_norm": (f"x [{4096 // k}, 1024] fp32, fwd+bwd", lambda impl: _layer_norm_case(impl, 4096 // k, 1024)),
        "scaled_masked_softmax": (f"causal [1, 16, {512 // k}, {512 // k}] fp32, fwd+bwd",
                                  lambda impl: _softmax_case(impl, 16, 512 // k)),
        "adamw_step": (f"flat {16 // k}M fp32 partition, one step", lambda impl: _adamw_case(impl, (16 << 20) // k)),
    }
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.reps} interleaved reps (ms); "
          "ratio = eager / impl")
    for op, (what, make) in cases.items():
        print(f"\n{op}: {what}")
        runs, first_s = {}, {}
        for impl in [i for i in IMPLS[op] if i != "triton"]:
            runs[impl] = make(impl)
            start = time.perf_counter()
            runs[impl]()  # warm-up; for "compile" this is the compilation
            first_s[impl] = time.perf_counter() - start
            runs[impl]()  # a second warm-up: compiled AdamW recompiles once when `step` first changes
        medians = _interleaved_medians_ms(runs, args.reps)
        for impl, ms in medians.items():
            print(f"  {impl:12s} {ms:9.2f} ms   x{medians['torch'] / ms:5.2f} vs eager   "
                  f"(first call {first_s[impl]:.1f} s)")

if __name__ == "__main__":
    main()
