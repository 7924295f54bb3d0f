"""Context parallelism on this machine's cores: one LLaMA micro-batch at a long sequence, forward + backward, in one
process against CP 2 on two processes for each comm type: step time, activation bytes per rank, CP bytes.

    python -m bench.bench_context [--seq-length 4096 --hidden-size 256 --heads 8 --groups 2 --num-layers 2
                                   --rounds 5]

The model: mpzero's GPTModel as the LLaMA family builds it (RMSNorm, SwiGLU, RoPE, GQA), fp32, vocabulary 1024,
no dropout, built from the same weights in every variant. Variants: one process on one thread (the baseline), one
process on two threads, and CP 2 (two forked gloo ranks, one thread each) for p2p, all_gather and a2a. One process
runs the attention backend `auto` picks on the CPU (torch's flash kernel); p2p and all_gather run mpzero's blockwise
attention, a2a the same flash kernel on half the heads. A round runs every variant once, in turn (a slower moment of
the shared machine hits them all): each forks its ranks, builds the model, takes one warm-up step and times
`--steps` more; the fastest round's median step is reported, with the CPU time of the rank's process beside it
(what it computed and copied, not the time it waited for a core). Ratios are to the one-thread baseline.
Activations: the bytes a micro-batch's forward keeps for backward on a rank (saved-tensor hooks, unique storages,
parameters excluded), checked against mpzero.activations.formula, and the K/V buffers the exchange holds while a
layer attends (`exchange_term`). CP bytes: what the rank sent on its CP group per step, against
`cp_comm_theory`. The load average is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from mpzero.activations import SavedBytesCounter, activation_formula, exchange_term
from mpzero.context_parallel import cp_comm_theory, split_batch
from mpzero.models import GPTConfig, GPTModel
from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import seed_everything
from tests.distributed import run_ranks

VARIANTS = {"1 process, 1 thread": (1, "p2p", 1), "1 process, 2 threads": (1, "p2p", 2),
            "CP 2 p2p": (2, "p2p", 1), "CP 2 all_gather": (2, "all_gather", 1), "CP 2 a2a": (2, "a2a", 1)}


def _config(args, cp: int, comm: str) -> GPTConfig:
    return GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.heads,
                     vocab_size=1024, max_position_embeddings=args.seq_length, seq_length=args.seq_length,
                     hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm", swiglu=True,
                     position_embedding_type="rope", add_position_embedding=False, group_query_attention=True,
                     num_query_groups=args.groups, add_bias_linear=False, untie_embeddings_and_output_weights=True,
                     context_parallel_size=cp, cp_comm_type=comm)


def _rank(args, cp: int, comm: str, threads: int) -> dict:
    torch.set_num_threads(threads)
    groups = init_parallel(1, cp_size=cp)
    config = _config(args, cp, comm)
    model = GPTModel(config, groups.tp, seed_everything(1, 0, groups.device), cp=groups.cp)
    tokens = torch.randint(0, 1024, (1, args.seq_length + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = split_batch(tokens, cp, groups.cp.rank)
    counter, walls, cpus, sent = SavedBytesCounter(model), [], [], []
    for step in range(args.steps + 1):
        model.zero_grad(set_to_none=True)
        torch.distributed.barrier()
        mark, start, start_cpu = groups.cp.stats.total(), time.perf_counter(), time.process_time()
        with counter.counting() if step == 0 else _nothing():
            loss = model(inputs, labels).mean()
        loss.backward()
        torch.distributed.barrier()
        if step:
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - start_cpu)
            sent.append(groups.cp.stats.total() - mark)
    setting = model.activation_setting(1, args.seq_length, torch.float32, groups.device)
    exchange = exchange_term(setting)
    return {"wall": statistics.median(walls), "cpu": statistics.median(cpus), "saved": counter.total_bytes,
            "formula": activation_formula(setting).micro_batch_bytes, "exchange": counter.exchange_peak,
            "exchange_formula": exchange.bytes if exchange else 0, "sent": statistics.median(sent),
            "theory": cp_comm_theory(config, 1, 1, args.seq_length, 4, 1)[0]}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f} (1 min)", flush=True)
    results = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, (cp, comm, threads) in VARIANTS.items():
            results[name].append(run_ranks(cp, _rank, args, cp, comm, threads, deadline=1800)[0])
    print(f"load average after: {os.getloadavg()[0]:.2f} (1 min)")
    base = min(r["wall"] for r in results["1 process, 1 thread"])
    base_bytes = results["1 process, 1 thread"][0]["saved"]
    print(f"LLaMA h {args.hidden_size}, {args.heads} heads, {args.groups} K/V groups, {args.num_layers} layers, "
          f"s {args.seq_length}, b 1, fp32; forward + backward of one micro-batch, rank 0's figures")
    print("| variant | step s fastest (median) | vs 1 thread | CPU s/step | activations B/rank (formula) "
          "| vs 1 process | K/V while attending (formula) | CP bytes/step (theory) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, runs in results.items():
        fastest, median = min(r["wall"] for r in runs), statistics.median(r["wall"] for r in runs)
        first = runs[0]
        print(f"| {name} | {fastest:.3f} ({median:.3f}) | {fastest / base:.2f}x | "
              f"{statistics.median(r['cpu'] for r in runs):.3f} | {first['saved']:,} ({first['formula']:,}) | "
              f"{first['saved'] / base_bytes:.3f}x | {first['exchange']:,} ({first['exchange_formula']:,}) | "
              f"{first['sent']:,.0f} ({first['theory']:,.0f}) |")


if __name__ == "__main__":
    main()
