"""gpu-check's GPT-2 step variants timed in interleaved rounds: what one 10-step window cannot rank. On an H100
the host-bound step moved by up to 25% from one window to the next (bench/README.md at 5a79686, "On one H100, a
third time"), so bench_gpt2's variant-after-variant figures rank nothing closer than that. bench_gpt2 itself ends with
such rounds of variants 2-5 and 11 when its part has time left (gpt2_step.interleaved_rounds is the shared loop).

    python -m bench.bench_rounds [--variants 2 3 4 5 11] [--rounds 8] [--steps 10] [--micro-batch-size 8] [--list]

Variants by their index in tests/gpu/check/gpt2_step.variants (`--list` prints them; the default, bench_gpt2's:
eager + torch.compile, mpzero --torch-compile, the same with --cuda-graph-impl local, that with the loss in one
chunk, and with the step launched without a host synchronisation). Each is built and warmed up (3 steps) once;
then every round runs `--steps` steps of each in turn, timed with the device synchronised at both ends. Printed:
the median (min-max) of the rounds' ms/step, the first variant's median over each one's (above 1: faster than the
first), and on a GPU MFU against the bf16 matmul peak measured in the same run (in brackets: against the GPU's
datasheet peak, mpzero.training.peak_flops). Without CUDA it runs at a tiny shape on the CPU: the variants build
and train before a GPU is lent.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from mpzero.parallel import init_parallel
from mpzero.training import datasheet_bf16_tflops
from tests.gpu.check.gpt2_step import (GPT2_124M, ROUNDS_VARIANTS, Shape, gpt_config, interleaved_rounds,
                                       matmul_peak_tflops, timed_steps, variants)

TINY = Shape(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=500)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", type=int, nargs="+", default=list(ROUNDS_VARIANTS))
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--list", action="store_true", help="print the variants' indices and names, run nothing")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    shape = GPT2_124M if cuda else TINY
    groups = init_parallel(1)  # NCCL on a GPU, gloo here: a world of one
    tokens = torch.randint(0, shape.vocab_size, (a.micro_batch_size, shape.seq_length + 1), device=groups.device)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    named = variants(shape, groups, inputs, labels)
    if a.list:
        for index, (name, _) in enumerate(named):
            print(f"{index}: {name}")
        return {}
    if a.rounds < 1 or a.steps < 1:
        p.error("--rounds and --steps must be at least 1")
    for index in a.variants:
        if not 0 <= index < len(named):
            p.error(f"--variants {index}: there are variants 0-{len(named) - 1} (--list names them)")
    peak = matmul_peak_tflops() if cuda else None
    datasheet = datasheet_bf16_tflops(torch.cuda.get_device_name(0)) if cuda else None
    steps = {index: named[index][1]() for index in a.variants}
    for step in steps.values():  # compilation, autotuning, CUDA graph recording
        timed_steps(step, 3, cuda)
    times = interleaved_rounds(steps, a.rounds, a.steps, cuda)
    medians = {index: statistics.median(t) for index, t in times.items()}
    first = medians[a.variants[0]]
    flops_per_step = gpt_config(shape, cross_entropy_chunk_size=0).flops_per_token() * inputs.numel()
    print(f"{shape}, micro-batch {a.micro_batch_size}, {'cuda' if cuda else 'cpu'}: {a.rounds} rounds of {a.steps} "
          f"steps, each variant in turn; ms/step median (min-max)"
          + (f"; MFU against the bf16 matmul peak measured here, {peak:.0f} TFLOP/s" if peak else "")
          + (f" (and against the datasheet's {datasheet:g})" if datasheet else ""))
    for index in steps:
        ms = [t * 1e3 for t in times[index]]
        mfu = f"  MFU {flops_per_step / medians[index] / (peak * 1e12):.3f}" if peak else ""
        mfu += f" ({flops_per_step / medians[index] / (datasheet * 1e12):.3f})" if datasheet else ""
        print(f"{index}: {statistics.median(ms):8.2f} ({min(ms):.2f}-{max(ms):.2f})  x{first / medians[index]:.3f}"
              f"{mfu}  {named[index][0]}")
    return medians


if __name__ == "__main__":
    main()
