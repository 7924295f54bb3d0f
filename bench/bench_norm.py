"""The optimizer step's gradient norm on a CPU (issue 47), against the arithmetic it had and against torch, in one run.

    python bench/bench_norm.py                                  # norm alone, then the step at world 2, stages 0-3
    python bench/bench_norm.py --old-checkout ../old ../main    # + the step of other commits' mpzero, interleaved
    python bench/bench_norm.py --hidden-size 768 --num-layers 2 --vocab-size 50304   # another shape

One GPT (default h 256, 4 layers, 8 heads, vocab 8192, seq 256: 5.3M parameters), fp32, gloo, one thread per rank.
1. The norm alone, over that model's gradients laid end to end (one bucket, as stage 0 holds them), one rank:
   mpzero's fp64 sum of squares (`mpzero.fused.sum_of_squares`, one run), the same arithmetic as it was before
   issue 47 (a fresh fp64 copy of up to 4M elements of the run at a time), as it was at 5833d48 (the same, one
   parameter at a time), and torch's fp32 norms: `torch.nn.utils.get_total_norm` and `clip_grad_norm_` (foreach).
2. The optimizer step (`ZeroOptimizer.step()`: the norm, its all-reduce, clipping, AdamW, stages 1-3's parameter
   all-gather), world 2, per ZeRO stage, against torch's step at stage 0 on the same model (DDP's gradients,
   `clip_grad_norm_(foreach=True)`, fused AdamW: the AdamW kernel mpzero runs on a CPU). --old-checkout DIR... (e.g.
   `git worktree add DIR 5833d48`) also times each DIR's mpzero, in rounds interleaved with this tree's.
Each figure is the median over rounds of each round's median; the spread printed is the rounds' min-max.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD_CHUNK = 1 << 22  # the fp64 copy's elements before issue 47


def old_sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """The fp64 sum of squares before issue 47: a fresh fp64 copy of each 4M-element chunk."""
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, x.numel(), OLD_CHUNK):
        chunk = x[start:start + OLD_CHUNK].to(torch.float64)
        total += torch.dot(chunk, chunk)
    return total


def _model(a, groups):
    from mpzero.models import GPTConfig, GPTModel
    from mpzero.tensor_parallel import seed_everything

    config = GPTConfig(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
                       vocab_size=a.vocab_size, max_position_embeddings=a.seq_length, hidden_dropout=0.0,
                       attention_dropout=0.0)
    return GPTModel(config, groups.tp, seed_everything(1, 0, groups.device), device=groups.device)


def _batch(a, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_length + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _median_ms(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _norm_rank(a) -> dict[str, list[float]]:
    """Part 1 on a world of one: each way of taking the norm timed in rounds, interleaved."""
    from mpzero.fused import sum_of_squares
    from mpzero.parallel import init_parallel

    model = _model(a, init_parallel(1))
    inputs, labels = _batch(a, 0)
    model(inputs, labels).mean().backward()
    params = [p for p in model.parameters() if p.grad is not None]
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    pieces = flat.split([p.numel() for p in params])
    ways = {"mpzero now: one run, 256K-element fp64 chunks": lambda: sum_of_squares(flat),
            "before issue 47: one run, fresh 4M-element fp64 copies": lambda: old_sum_of_squares(flat),
            "5833d48: each parameter, fresh fp64 copies": lambda: sum(old_sum_of_squares(p) for p in pieces),
            "torch get_total_norm (fp32, foreach)": lambda: torch.nn.utils.get_total_norm(
                [p.grad for p in params], foreach=True),
            "torch clip_grad_norm_ (fp32, foreach)": lambda: torch.nn.utils.clip_grad_norm_(
                params, 1.0, foreach=True)}
    for bits in a.cpu_chunks:
        ways[f"mpzero with 2^{bits}-element chunks"] = lambda bits=bits: _with_cpu_chunk(1 << bits, flat)
    results = {name: [] for name in ways}
    for _ in range(a.rounds):
        for name, way in ways.items():
            way()  # warm
            results[name].append(_median_ms(way, a.calls))
    results["elements"] = [float(flat.numel())]
    return results


def _with_cpu_chunk(elements: int, flat: torch.Tensor) -> torch.Tensor:
    from mpzero.fused import squares, sum_of_squares

    kept, squares.CPU_CHUNK = squares.CPU_CHUNK, elements
    try:
        return sum_of_squares(flat)
    finally:
        squares.CPU_CHUNK = kept


def _mpzero_rank(a, stage: int) -> float:
    """This rank's median ms of `ZeroOptimizer.step()` at `stage`."""
    from mpzero.parallel import init_parallel
    from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer

    groups = init_parallel(1)
    model = _model(a, groups)
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=stage), AdamConfig(lr=1e-4, clip_grad=1.0),
                        PrecisionConfig())
    inputs, labels = _batch(a, groups.dp_rank)
    return _timed_steps(a, lambda: opt.backward(model(inputs, labels).mean(), last_micro_batch=True), opt.step)


def _torch_rank(a) -> float:
    """This rank's median ms of torch's stage-0 step: clip_grad_norm_ (foreach) and fused AdamW after DDP."""
    from torch.nn.parallel import DistributedDataParallel

    from mpzero.parallel import init_parallel

    groups = init_parallel(1)
    model = _model(a, groups)
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    inputs, labels = _batch(a, groups.dp_rank)

    def step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=False)
    return _timed_steps(a, lambda: ddp(inputs, labels).mean().backward(), step)


def _timed_steps(a, backward, step) -> float:
    import torch.distributed as dist

    times = []
    for i in range(a.warmup + a.steps):
        backward()
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()  # the step of the slowest rank
        if i >= a.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _worker(a) -> None:
    """One round of part 2 in this process (this tree's or --old-checkout's mpzero): one JSON line of ms."""
    from tests.distributed import run_ranks

    torch.set_num_threads(1)
    results = {f"stage {s}": max(run_ranks(a.world_size, _mpzero_rank, a, s, deadline=600)) for s in a.stages}
    if a.peer:
        results["torch"] = max(run_ranks(a.world_size, _torch_rank, a, deadline=600))
    import mpzero
    print(json.dumps(results | {"mpzero": os.path.dirname(os.path.dirname(os.path.abspath(mpzero.__file__)))}))


def _round(a, checkout: str, peer: bool) -> dict[str, float]:
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--world-size", str(a.world_size),
            "--stages", *map(str, a.stages), "--steps", str(a.steps), "--warmup", str(a.warmup),
            *_shape_argv(a)] + (["--peer"] if peer else [])
    env = dict(os.environ, PYTHONPATH=checkout)
    done = subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the step's round in {checkout} failed:\n{done.stderr[-3000:]}")
    results = json.loads(done.stdout.strip().splitlines()[-1])
    if os.path.realpath(results.pop("mpzero")) != os.path.realpath(checkout):
        raise SystemExit(f"the round meant for {checkout} imported another mpzero: is it installed there?")
    return results


def _shape_argv(a) -> list[str]:
    return ["--hidden-size", str(a.hidden_size), "--num-layers", str(a.num_layers), "--num-attention-heads",
            str(a.num_attention_heads), "--seq-length", str(a.seq_length), "--micro-batch-size",
            str(a.micro_batch_size), "--vocab-size", str(a.vocab_size)]


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):8.2f} ({min(values):.2f}-{max(values):.2f})"


def _print_norms(a) -> None:
    from tests.distributed import run_ranks

    results = run_ranks(1, _norm_rank, a, deadline=1800)[0]
    elements = int(results.pop("elements")[0])
    now = statistics.median(results["mpzero now: one run, 256K-element fp64 chunks"])
    print(f"1. the norm of {elements:,} fp32 gradients, one rank, 1 thread, ms: median (min-max) of {a.rounds} "
          f"rounds, each the median of {a.calls} calls; ratio: to mpzero now")
    for name, values in results.items():
        print(f"  {name:56s} {_summary(values)}  {statistics.median(values) / now:6.2f}")


def _print_steps(a) -> None:
    trees = {"this tree": ROOT} | {checkout: checkout for checkout in a.old_checkout}
    rounds = {name: [] for name in trees}
    for _ in range(a.rounds):
        for name, checkout in trees.items():
            rounds[name].append(_round(a, checkout, peer=name == "this tree"))
    print(f"2. the optimizer step, world {a.world_size}, ms: median (min-max) of {a.rounds} interleaved rounds, "
          f"each the median of {a.steps} steps of the slowest rank; ratio: to torch's stage-0 step")
    torch_ms = statistics.median(r["torch"] for r in rounds["this tree"])
    for name, results in rounds.items():
        for key in results[0]:
            values = [r[key] for r in results]
            label = "torch: clip_grad_norm_ (foreach) + fused AdamW" if key == "torch" else f"mpzero {key}"
            print(f"  {name:28s} {label:48s} {_summary(values)}  {statistics.median(values) / torch_ms:6.2f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=10, help="norm calls per round (part 1)")
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps per round (part 2)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--old-checkout", nargs="+", default=[],
                   help="other commits' checkouts whose step is timed in interleaved rounds")
    p.add_argument("--skip-norm", action="store_true", help="part 2 only")
    p.add_argument("--cpu-chunks", type=int, nargs="*", default=[], metavar="BITS",
                   help="part 1 also with mpzero's CPU chunk set to 2^BITS elements (a sweep of the constant)")
    p.add_argument("--skip-steps", action="store_true", help="part 1 only")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for checkout in a.old_checkout:
        if not os.path.isdir(os.path.join(checkout, "mpzero")):
            p.error(f"--old-checkout {checkout} holds no mpzero/ folder: give a checkout of this repository")
    if a.worker:
        return _worker(a)
    print(f"cpu, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f} | h {a.hidden_size} layers {a.num_layers} "
          f"seq {a.seq_length} batch {a.micro_batch_size} vocab {a.vocab_size}", flush=True)
    if not a.skip_norm:
        torch.set_num_threads(1)
        _print_norms(a)
    if not a.skip_steps:
        _print_steps(a)


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())  # tests.distributed: this tree's, or --old-checkout's in a worker
    main()
