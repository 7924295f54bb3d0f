"""Two torchrun agents as two nodes against one agent, the same 4 processes on this machine (TP 2 x DP 2):
what the launcher and the c10d rendezvous add to a run (one machine, so no network: expect parity).

    python bench/bench_multinode.py [--repeat 3] [--train-iters 60]

Each run is pretrain_gpt.py on mock data (2 layers, hidden 128, 64 tokens, global batch 16); per run: the wall
time from launch to exit (start-up, rendezvous, training, shutdown) and the median of the `elapsed time per
iteration` lines after the first (which holds the first iteration's one-off costs). The variants alternate, so
outside load hits both alike; each figure is the best of --repeat runs.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--tensor-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads",
         "4", "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "1e-3",
         "--mock-data", "--vocab-size", "1024", "--log-interval", "10", "--eval-iters", "0"]
ELAPSED = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run(nodes: int, iters: int, tmp: str) -> tuple[float, float]:
    """(wall seconds, median ms per iteration) of one job on `nodes` agents of 4 // nodes processes."""
    argv = ["pretrain_gpt.py"] + MODEL + ["--train-iters", str(iters)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": tmp, "PYTHONPATH": ROOT}
    if nodes == 1:
        launch = [["--standalone", "--nproc-per-node", "4"]]
    else:
        rdzv = ["--nnodes", str(nodes), "--nproc-per-node", str(4 // nodes), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"localhost:{_free_port()}", "--rdzv-id", "bench"]
        launch = [rdzv] * nodes
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *flags, *argv], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for flags in launch]
    outputs = [p.communicate(timeout=600) for p in procs]
    wall = time.perf_counter() - start
    if any(p.returncode for p in procs):
        raise SystemExit("a run failed:\n" + "\n".join(err[-2000:] for _, err in outputs))
    times = [float(m) for out, _ in outputs for m in ELAPSED.findall(out)]
    return wall, statistics.median(times[1:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--train-iters", type=int, default=60)
    args = p.parse_args(argv)
    print(f"cpus: {os.cpu_count()}; load average before: {os.getloadavg()[0]:.2f}")
    best = {1: (float("inf"), float("inf")), 2: (float("inf"), float("inf"))}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeat):
            for nodes in (1, 2):
                wall, step = run(nodes, args.train_iters, tmp)
                best[nodes] = (min(best[nodes][0], wall), min(best[nodes][1], step))
    for nodes, (wall, step) in best.items():
        print(f"{nodes} node(s) x {4 // nodes} processes: {wall:6.1f} s launch to exit, {step:7.1f} ms per iteration")
    print(f"2 nodes / 1 node: {best[2][1] / best[1][1]:.2f}x per iteration, {best[2][0] / best[1][0]:.2f}x wall time "
          f"(same machine: the launcher and rendezvous only; load average after: {os.getloadavg()[0]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
