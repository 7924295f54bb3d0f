"""Time and memory of the output projection + cross entropy, forward and backward, at one TP rank: the logits path
(F.linear, -inf padding, `vocab_parallel_cross_entropy`) against the chunked fused one
(`vocab_parallel_linear_cross_entropy`, --cross-entropy-chunk-size), its chunk arithmetic by the reference and
fused by torch.compile (--cross-entropy-loss-fusion; compiled in the untimed first pass). Each path runs in a
process of its own;
memory is the process's peak resident set above what it held with the inputs built (CPU), or
torch.cuda.max_memory_allocated above the inputs (CUDA), and the bytes saved for backward (SavedBytesCounter). On a
CPU the compiled path's resident peak includes the compiler's own memory.

    python bench/bench_cross_entropy.py [--tokens 2048 --hidden-size 768 --vocab 50304 --chunk-sizes 0 1024 4096]
    python bench/bench_cross_entropy.py --tokens 8192 --chunk-sizes 2048 --dtype bfloat16 --impls torch compile
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from mpzero.activations import SavedBytesCounter
from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy


def _loss(x, weight, target, tp, vocab, chunk, impl):
    if chunk:
        return vocab_parallel_linear_cross_entropy(x, weight, target, tp, vocab, chunk, impl=impl)
    logits = F.linear(x, weight)
    logits = logits.masked_fill(torch.arange(weight.size(0), device=x.device) >= vocab, float("-inf"))
    return vocab_parallel_cross_entropy(logits, target, tp)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_one(args) -> dict:
    """One path in this process: median seconds of forward + backward, peak bytes, saved bytes."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    tp = init_parallel(1).tp
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, args.tokens, args.hidden_size, generator=g).to(device, dtype).requires_grad_()
    weight = torch.nn.Parameter((torch.randn(args.vocab, args.hidden_size, generator=g) * 0.02).to(device, dtype))
    target = torch.randint(0, args.vocab - 47, (1, args.tokens), generator=g).to(device)
    vocab = args.vocab - 47  # GPT-2's 50257 in 50304 padded rows
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    base_rss = _resident_bytes()
    counter = SavedBytesCounter(torch.nn.ParameterList([weight]))  # the weight is a parameter, not an activation
    with counter.counting():
        _loss(x, weight, target, tp, vocab, args.chunk, args.impl).mean().backward()
    x.grad = weight.grad = None
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        _loss(x, weight, target, tp, vocab, args.chunk, args.impl).mean().backward()
        _sync(device)
        times.append(time.perf_counter() - start)
        x.grad = weight.grad = None
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:  # the high-water mark of the resident set, above what the inputs alone held
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss
    return {"chunk": args.chunk, "seconds": statistics.median(times), "peak_bytes": peak,
            "saved_bytes": counter.total_bytes}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden-size", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50304, help="padded vocabulary (the last 47 rows are padding)")
    p.add_argument("--chunk-sizes", type=int, nargs="+", default=[0, 1024, 4096], help="0: the logits path")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--impls", nargs="+", choices=("torch", "compile"), default=["torch", "compile"],
                   help="the chunked path's arithmetic: the reference, and fused by torch.compile")
    p.add_argument("--chunk", type=int, default=None, help=argparse.SUPPRESS)  # a child's one path
    p.add_argument("--impl", default="torch", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.chunk is not None:
        print(json.dumps(run_one(args)))
        return
    print(f"tokens {args.tokens}, h {args.hidden_size}, V {args.vocab}, {args.dtype} on {args.device}, "
          f"{args.threads} threads")
    paths = [(chunk, impl) for chunk in args.chunk_sizes for impl in (["torch"] if chunk == 0 else args.impls)]
    for chunk, impl in paths:
        child = [a for a in (argv if argv is not None else sys.argv[1:])] + ["--chunk", str(chunk), "--impl", impl]
        out = subprocess.run([sys.executable, os.path.abspath(__file__)] + child, capture_output=True, text=True,
                             check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        name = "logits path" if chunk == 0 else f"chunked {chunk}, {impl}"
        print(f"{name:>22}: {r['seconds'] * 1e3:8.1f} ms  peak {r['peak_bytes'] / 2 ** 20:8.1f} MiB  "
              f"saved for backward {r['saved_bytes'] / 2 ** 20:8.1f} MiB")


if __name__ == "__main__":
    main()
