"""Tokens/s of one training step (forward, backward, optimizer) of mpzero's GPT at TP=1 against a plain eager
PyTorch GPT-2 of the same size (nanoGPT style: `F.scaled_dot_product_attention`, torch.optim.AdamW), measured in
the same run, and where the time goes. mpzero runs as a world of one through its ZeRO-1 optimizer (the step a
training run takes), with each attention backend, with `--torch-compile` and with it and
`--cross-entropy-loss-fusion` (mpzero-compile-ce); the eager model with and without torch.compile.

    python bench/bench_step.py [--hidden-size 256 --num-layers 4 --seq-length 256 --micro-batch-size 8]
    python bench/bench_step.py --profile            # + a per-op breakdown of one step of each model
    python bench/bench_step.py --variants eager mpzero-local mpzero-flash      # skip the compiled ones

Columns: tokens/s, ratio to eager (above 1: faster), and ops per step: CUDA kernels launched (on a GPU) or leaf
aten ops dispatched (on a CPU; a compiled region's fused kernels are not aten ops and are not counted there),
from torch.profiler over one step. A launch-bound GPU pays per kernel, so fewer is faster there.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from baselines import eager_gpt2, step_profile  # bench/baselines.py, beside this script

from mpzero.models import GPTConfig, GPTModel
from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import seed_everything
from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer

VARIANTS = ("eager", "eager-compile", "mpzero-local", "mpzero-flash", "mpzero-compile", "mpzero-compile-ce")


def eager_step(a, device, dtype, compiled: bool):
    model = eager_gpt2(a.vocab_size, a.hidden_size, a.num_layers, a.num_attention_heads, a.seq_length).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    run = torch.compile(model) if compiled else model
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext())

    def step(inputs, labels):
        with autocast:
            loss = run(inputs, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def mpzero_step(a, groups, dtype, backend: str, compiled: bool, fused_loss: bool = False):
    config = GPTConfig(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
                       vocab_size=a.vocab_size, max_position_embeddings=a.seq_length, hidden_dropout=0.0,
                       attention_dropout=0.0, attention_backend=backend, torch_compile=compiled,
                       cross_entropy_chunk_size=a.cross_entropy_chunk_size,
                       cross_entropy_impl="compile" if fused_loss else "auto")
    model = GPTModel(config, groups.tp, seed_everything(1, 0, groups.device), device=groups.device)
    precision = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=1), AdamConfig(lr=1e-4), PrecisionConfig(precision))

    def step(inputs, labels):
        loss = model(inputs, labels).mean()
        opt.backward(loss, last_micro_batch=True)
        opt.step()
    return step


def timed(step, inputs, labels, steps: int, warmup: int = 2) -> float:
    """Median seconds per step after `warmup` steps (compilation happens there)."""
    sync = torch.cuda.synchronize if inputs.is_cuda else (lambda: None)
    times = []
    for i in range(warmup + steps):
        sync()
        start = time.perf_counter()
        step(inputs, labels)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--cross-entropy-chunk-size", type=int, default=GPTConfig.cross_entropy_chunk_size,
                   help="mpzero's loss in chunks of this many tokens (0: the whole logits)")
    p.add_argument("--bf16", action="store_true", help="bf16 (eager: autocast; mpzero: bf16 parameters)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--profile", action="store_true", help="print each variant's per-op breakdown of one step")
    a = p.parse_args(argv)
    groups = init_parallel(1)
    device, dtype = groups.device, torch.bfloat16 if a.bf16 else torch.float32
    tokens = torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_length + 1), device=device)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    n_tokens = a.micro_batch_size * a.seq_length
    builders = {"eager": lambda: eager_step(a, device, dtype, False),
                "eager-compile": lambda: eager_step(a, device, dtype, True),
                "mpzero-local": lambda: mpzero_step(a, groups, dtype, "local", False),
                "mpzero-flash": lambda: mpzero_step(a, groups, dtype, "flash", False),
                "mpzero-compile": lambda: mpzero_step(a, groups, dtype, "flash", True),
                "mpzero-compile-ce": lambda: mpzero_step(a, groups, dtype, "flash", True, True)}
    print(f"{device.type}, threads {torch.get_num_threads()}, {dtype} | h {a.hidden_size} layers {a.num_layers} "
          f"seq {a.seq_length} batch {a.micro_batch_size} vocab {a.vocab_size} | loss chunk "
          f"{a.cross_entropy_chunk_size} | median of {a.steps} steps")
    unit = "CUDA kernels" if device.type == "cuda" else "leaf aten ops"
    baseline, tables = None, {}
    for name in a.variants:
        step = builders[name]()
        seconds = timed(step, inputs, labels, a.steps)
        profiled = step_profile(step, inputs, labels)
        ops, tables[name] = profiled.ops, profiled.table
        baseline = baseline or (seconds if name == "eager" else None)
        ratio = f"{baseline / seconds:.3f}" if baseline else "-"
        print(f"{name:16s} {n_tokens / seconds:10.0f} tokens/s  {seconds * 1000:8.1f} ms/step  ratio to eager "
              f"{ratio}  {unit} per step {ops}", flush=True)
        del step
    if a.profile:
        for name, table in tables.items():
            print(f"\n== {name}: one step, by self time ==\n{table}")


if __name__ == "__main__":
    main()
