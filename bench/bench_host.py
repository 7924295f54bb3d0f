"""Host time of one training step where the compute is negligible: what a launch-bound GPU step waits for.

    python -m bench.bench_host [--rounds 15]

gpu-check's GPT-2 step variants (tests/gpu/check/gpt2_step.py: nanoGPT's eager step with and without torch.compile,
mpzero's ZeRO-1 bf16 step with its defaults and with --torch-compile) at GPT-2's depth (12 layers) but a tiny width
(hidden 64, seq 16, batch 1, vocab 500), on this CPU with one thread. The arithmetic then costs next to nothing and
the step's time is what the host does: Python, dispatch, autograd, the compiled regions' wrappers. On an H100 a
GPT-2 124M step is host-bound in part: eager + torch.compile's kernels took 21.6 ms of a 25.5 ms step, mpzero's 21.6
of 27.6 (bench/README.md, "On one H100, again"). mpzero with --torch-compile is measured twice: as a TP 1 run
compiles it (embedding, layers and final norm one region) and with one region per layer (as a ZeRO-3, TP > 1 or
recomputing run does).
Rounds interleave the variants (each round: 5 steps of each); medians; ratio = eager + compile's time / the
variant's (above 1: less host time than eager + compile).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mpzero.parallel import init_parallel
from tests.gpu.check.gpt2_step import Shape, eager_step, mpzero_step

SHAPE = Shape(num_layers=12, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=500)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    groups = init_parallel(1)
    tokens = torch.randint(0, SHAPE.vocab_size, (1, SHAPE.seq_length + 1))
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    builders = {"eager PyTorch": lambda: eager_step(SHAPE, inputs, labels, False),
                "eager + torch.compile": lambda: eager_step(SHAPE, inputs, labels, True),
                "mpzero defaults": lambda: mpzero_step(SHAPE, groups, inputs, labels, "auto"),
                "mpzero --torch-compile, a region per layer": lambda: mpzero_step(SHAPE, groups, inputs, labels, "auto",
                                                                                  compiled=True, one_region=False),
                "mpzero --torch-compile (one region)": lambda: mpzero_step(SHAPE, groups, inputs, labels, "auto",
                                                                           compiled=True)}
    steps = {name: build()[0] for name, build in builders.items()}
    for step in steps.values():  # compilation and warm-up
        for _ in range(5):
            step()
    times = {name: [] for name in steps}
    for _ in range(a.rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(5):
                step()
            times[name].append((time.perf_counter() - start) / 5)
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["eager + torch.compile"]
    print(f"host time per step, GPT-2 depth at a tiny width ({SHAPE}), 1 thread, median of {a.rounds} rounds")
    for name, seconds in medians.items():
        print(f"{name:44s} {seconds * 1000:7.2f} ms   ratio to eager + compile {base / seconds:.3f}")


if __name__ == "__main__":
    main()
