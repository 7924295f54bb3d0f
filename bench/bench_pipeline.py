"""Pipeline parallelism on this machine's cores: each rank's idle time per step against its schedule's formula,
for 1F1B, interleaved 1F1B (v = 2) and ZB-H1, at several micro-batch counts, beside one process at the same
global batch.

    python bench/bench_pipeline.py [--pp 2] [--micro-batches 4 8 16] [--iterations 6]

PP ranks are forked processes with one thread each (on 2 cores: one core a rank), fp32, gloo, a small vocabulary
so that the stages cost alike. Per rank and step: the step's wall time (forward and backward of the global batch,
after a barrier), its busy time (the executor's compute actions, `run_schedule(timings=...)`, waiting excluded)
and idle = wall - busy. Beside it: the schedule's closed form (`mpzero.pipeline.bubble`, equal stages) with the
compute times the ranks measured in the same step (F, B; ZB-H1: F, I, W, each per micro-batch and chunk, the
ranks' mean), and the schedule simulated with each rank's own times (`simulate`, point-to-point free), which is
the formula for stages of unequal cost. Goals (issue 43): idle within 10% of the formula; ZB-H1's idle <= 0.4x
1F1B's at the same m (ZB-H1 holds p micro-batches' inputs on every rank, 1F1B p on its first).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from mpzero.cli.arguments import parse_args, run_config  # noqa: E402
from mpzero.pipeline import Pipeline, Times, bubble, build, run_schedule, simulate  # noqa: E402
from mpzero.training import MockGPTDataset, build_training_state, micro_batch_indices  # noqa: E402
from mpzero.training.batches import MicroBatches  # noqa: E402
from pretrain_gpt import _provider  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402

SCHEDULES = {"1f1b": [], "interleaved": ["--num-virtual-stages-per-pipeline-rank", "2"],
             "zb-h1": ["--enable-zero-bubble"]}


def model_flags(a, m: int) -> list[str]:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", "8",
            "--seq-length", str(a.seq), "--micro-batch-size", str(a.micro_batch), "--global-batch-size",
            str(a.micro_batch * m), "--train-iters", "1000", "--lr", "1e-4", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--mock-data", "--vocab-size", "128", "--zero-stage", "1"]


def _rank(a, m: int, flags: list[str]) -> dict:
    torch.set_num_threads(1)
    run = run_config(parse_args(model_flags(a, m) + flags), dist.get_world_size())
    state = build_training_state(run, _provider(run), run.parallel.join())
    data = MockGPTDataset(run.data.vocab_size, a.seq, 1, run.training.global_batch_size)
    groups, schedule, records = state.groups, state.pipeline, []
    for iteration in range(a.warmup + a.iterations):
        indices = micro_batch_indices(0, run.training.global_batch_size, a.micro_batch, groups.dp_rank,
                                      groups.dp_size)
        batches = MicroBatches(data, indices, groups.device)
        state.optimizer.zero_grad()
        dist.barrier()
        timings, start = {}, time.perf_counter()
        if schedule is None:  # one process: the same passes without a pipeline
            for i, idx in enumerate(indices):
                loss = state.model.module(batches.tokens(i), batches.labels(i)).mean() / len(indices)
                state.optimizer.backward(loss, last_micro_batch=i == len(indices) - 1)
        else:
            run_schedule(schedule.run, schedule.train_steps, schedule.rank, batches.tokens, batches.labels,
                         state.optimizer, timings=timings)
        wall = time.perf_counter() - start
        state.optimizer.step(1e-4)
        if iteration >= a.warmup:
            records.append((wall, timings))
    state.optimizer.close()
    return _summary(records, schedule)


def _summary(records, schedule) -> dict:
    """Median step wall time; per step this rank's idle time and its compute times (per action kind)."""
    out = {"wall": statistics.median(wall for wall, _ in records)}
    if schedule is not None:
        out["steps"] = [(wall - sum(sum(t) for t in timings.values()),
                         Times(**{k: statistics.mean(timings.get(k, [0.0])) for k in ("F", "B", "I", "W")}))
                        for wall, timings in records]
    return out


def _formulas(kind: str, pipe, ranks: list[dict]) -> tuple[float, float, float]:
    """(median idle, the closed form with the ranks' mean times, the simulation with each rank's times), medians
    over the steps, the idle a median over the ranks."""
    idle, closed, simulated = [], [], []
    for step in range(len(ranks[0]["steps"])):
        times = [r["steps"][step][1] for r in ranks]
        mean = Times(**{k: statistics.mean(getattr(t, k) for t in times) for k in ("F", "B", "I", "W")})
        idle.append(statistics.median(r["steps"][step][0] for r in ranks))
        closed.append(bubble(kind, pipe, mean))
        simulated.append(statistics.median(simulate(pipe, build(kind, pipe), times).idle))
    return statistics.median(idle), statistics.median(closed), statistics.median(simulated)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iterations", type=int, default=6)
    a = p.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.1f} | {a.layers} layers, hidden {a.hidden}, seq {a.seq}, micro-batch "
          f"{a.micro_batch}, fp32, PP {a.pp} ranks of one thread")
    print("| schedule | m | one process ms | PP ms | speed-up | idle ms | closed form ms | simulated ms | "
          "idle / simulated |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in a.micro_batches:
        single = run_ranks(1, _rank, a, m, [], deadline=3600)[0]
        idles = {}
        for kind, flags in SCHEDULES.items():
            ranks = run_ranks(a.pp, _rank, a, m, ["--pipeline-model-parallel-size", str(a.pp)] + flags,
                              deadline=3600)
            v = 2 if kind == "interleaved" else 1
            idle, closed, simulated = _formulas(kind, Pipeline(a.pp, v, m), ranks)
            wall = max(r["wall"] for r in ranks)
            idles[kind] = idle
            print(f"| {kind} | {m} | {single['wall'] * 1e3:.1f} | {wall * 1e3:.1f} | {single['wall'] / wall:.2f}x | "
                  f"{idle * 1e3:.1f} | {closed * 1e3:.1f} | {simulated * 1e3:.1f} | {idle / simulated:.2f} |",
                  flush=True)
        print(f"ZB-H1 idle / 1F1B idle at m = {m}: {idles['zb-h1'] / idles['1f1b']:.2f}", flush=True)


if __name__ == "__main__":
    main()
