"""Host time of one training step where the compute is negligible: what a launch-bound GPU step waits for.

    python -m bench.bench_host [--rounds 15]

gpu-check's GPT-2 step variants (tests/gpu/check/gpt2_step.py: nanoGPT's eager step with and without torch.compile,
mpzero's ZeRO-1 bf16 step with its defaults and with --torch-compile) at GPT-2's depth (12 layers) but a tiny width
(hidden 64, seq 16, batch 1, vocab 500), on this CPU with one thread. The arithmetic then costs next to nothing and
the step's time is what the host does: Python, dispatch, autograd, the compiled regions' wrappers. On an H100 a
GPT-2 124M step is host-bound in part: eager + torch.compile's kernels took 21.6 ms of a 25.5 ms step, mpzero's 21.6
of 27.6 (bench/README.md, "On one H100, again"). mpzero with --torch-compile is measured three times: as a TP 1 run
compiles it (embedding, layers and final norm one region), with one region per layer (as a ZeRO-3, TP > 1 or
recomputing run does), and with the loss in one chunk. mpzero's loss is as on a GPU: fused (the compiled chunk
math, `auto` on CUDA) and in 4 chunks (GPT-2's 8192 tokens a micro-batch at the default chunk of 2048).
Each step is timed in its three phases: forward (the loss), backward, update (clipping, the optimizer's step,
clearing the gradients). On this CPU the update's time is mostly its arithmetic (eager's fused AdamW and clipping
run on the CPU here), which a GPU launches as a few multi-tensor kernels: the host time a GPU step waits for is
best compared on forward + backward. Rounds interleave the variants (each round: 5 steps of each); medians of the
rounds' per-step means; ratio = eager + compile's time / the variant's (above 1: less host time than eager +
compile), of the whole step and of forward + backward.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mpzero.parallel import init_parallel
from tests.gpu.check.gpt2_step import Shape, eager_step, mpzero_step

SHAPE = Shape(num_layers=12, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=500)
LOSS_CHUNKS = 4  # GPT-2 124M at micro-batch 8: 8192 tokens, --cross-entropy-chunk-size 2048


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    groups = init_parallel(1)
    tokens = torch.randint(0, SHAPE.vocab_size, (1, SHAPE.seq_length + 1))
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def mpzero(**choices):  # the loss as on a GPU: fused, in LOSS_CHUNKS chunks unless `choices` say otherwise
        choices = {"fused_loss": True, "loss_chunk": inputs.numel() // LOSS_CHUNKS, **choices}
        return lambda: mpzero_step(SHAPE, groups, inputs, labels, "auto", **choices)
    builders = {"eager PyTorch": lambda: eager_step(SHAPE, inputs, labels, False),
                "eager + torch.compile": lambda: eager_step(SHAPE, inputs, labels, True),
                "mpzero defaults": mpzero(),
                "mpzero --torch-compile, a region per layer": mpzero(compiled=True, one_region=False),
                "mpzero --torch-compile (one region)": mpzero(compiled=True),
                "mpzero --torch-compile, the loss in one chunk": mpzero(compiled=True, loss_chunk=inputs.numel())}
    steps = {name: build() for name, build in builders.items()}
    for step in steps.values():  # compilation and warm-up
        for _ in range(5):
            step()
    times = {name: [] for name in steps}  # per round: (forward, backward, update) seconds per step
    for _ in range(a.rounds):
        for name, step in steps.items():
            times[name].append(_phase_times(step, 5))
    medians = {name: [statistics.median(phase) for phase in zip(*rounds)] for name, rounds in times.items()}
    base = medians["eager + torch.compile"]
    print(f"host time per step, GPT-2 depth at a tiny width ({SHAPE}), 1 thread, median of {a.rounds} rounds; "
          f"ratio: eager + compile's time / the variant's")
    print(f"{'':44s} {'forward':>8s} {'backward':>8s} {'update':>8s} {'step':>8s}   ratio: step, forward + backward")
    for name, (forward, backward, update) in medians.items():
        print(f"{name:44s} {forward * 1e3:8.2f} {backward * 1e3:8.2f} {update * 1e3:8.2f} "
              f"{(forward + backward + update) * 1e3:8.2f}   {sum(base) / (forward + backward + update):.3f}, "
              f"{(base[0] + base[1]) / (forward + backward):.3f}")


def _phase_times(step, n: int) -> tuple[float, float, float]:
    """Seconds per step of each phase of `step` (a tests.gpu.check.gpt2_step.Step), over n steps."""
    phases = [0.0, 0.0, 0.0]
    for _ in range(n):
        start = time.perf_counter()
        loss = step.forward()
        forwarded = time.perf_counter()
        step.backward(loss)
        backwarded = time.perf_counter()
        step.update()
        end = time.perf_counter()
        phases[0] += forwarded - start
        phases[1] += backwarded - forwarded
        phases[2] += end - backwarded
    return phases[0] / n, phases[1] / n, phases[2] / n


if __name__ == "__main__":
    main()
