"""Context parallelism on this machine's cores: one LLaMA micro-batch at a long sequence, forward + backward, in one
process against CP 2 on two processes for each comm type: step time, activation bytes per rank, CP bytes.

    python -m bench.bench_context [--seq-length 4096 --hidden-size 256 --heads 8 --groups 2 --num-layers 2
                                   --rounds 5]
    python -m bench.bench_context --planner     # the planner's long-context rows instead (seconds, no ranks)

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

--planner: Llama-3 8B and 70B at 131,072 tokens (global batch 8 sequences, bf16) on H100-80GB (989 TF/s dense bf16,
the planner's other defaults: 50 % efficiency, NVLink 150 GB/s, 25 GB/s per rank across nodes), the fastest layout
that fits without context parallelism (CP 1) and with it (CP 1, 2, 4, 8), ZeRO 1 or 3, no offload, micro-batch 1,
every recomputation mode, TP up to 8: its device peak and the planner's tokens per second (mpzero.planner).
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


LLAMA3 = {"8B": ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
                  "--num-query-groups", "8", "--ffn-hidden-size", "14336"],
          "70B": ["--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64",
                  "--num-query-groups", "8", "--ffn-hidden-size", "28672"]}
LLAMA3_COMMON = ["--group-query-attention", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type",
                 "rope", "--no-position-embedding", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                 "--rotary-base", "500000", "--seq-length", "131072", "--attention-dropout", "0", "--hidden-dropout",
                 "0", "--bf16", "--global-batch-size", "8", "--micro-batch-size", "1", "--train-iters", "1", "--lr",
                 "1e-4", "--mock-data", "--vocab-size", "128256"]


def planner_rows() -> None:
    from mpzero.cli.arguments import parse_args, planner_sections
    from mpzero.planner import Machine, Planner, rank_plans
    from mpzero.planner.cost import Hardware
    print("| model | GPUs | CP sizes tried | best layout that fits | device peak GiB | tokens/s (per GPU) |")
    print("|---|---:|---|---|---:|---:|")
    for name, world in (("8B", 8), ("8B", 32), ("70B", 64), ("70B", 128)):
        args = parse_args(LLAMA3[name] + LLAMA3_COMMON)
        machine = Machine(world, 80 * 2 ** 30, device_reserve=2 * 2 ** 30, hardware=Hardware(device_tflops=989.0))
        planner = Planner(planner_sections(args, 128256), machine)
        for cps in ((1,), (1, 2, 4, 8)):
            layouts = planner.layouts(tps=(1, 2, 4, 8), stages=(1, 3), tiers=("none",), micro_batches=(1,),
                                      units=("layer",), cps=cps)
            fitting = [plan for plan in rank_plans([planner.evaluate(lay) for lay in layouts]) if plan.fits]
            best = fitting[0] if fitting else None
            text = best.layout.describe() if best else ("nothing fits" if layouts else
                                                         "no layout: DP = GPUs/(TP CP) exceeds the 8-sequence batch")
            peak = f"{best.device_peak / 2 ** 30:.1f}" if best else "-"
            speed = f"{best.cost.tokens_per_second:,.0f} ({best.cost.tokens_per_second / world:,.0f})" if best else "-"
            print(f"| Llama-3 {name} | {world} | {','.join(map(str, cps))} | {text} | {peak} | {speed} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--planner", action="store_true", help="the planner's long-context rows instead")
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    if args.planner:
        return planner_rows()
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
