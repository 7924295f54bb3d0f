"""Activation bytes and step time of every recomputation / sequence-parallel mode, and the largest micro-batch
and sequence each mode fits in an activation budget per rank.

    python -m bench.bench_activations [--hidden-size 512 --seq-length 512 --num-layers 4 --heads 8
                                       --micro-batch-size 2 --tp 2 --rounds 5 --dropout 0.1 --budget-mib 512]

One GPT (mpzero.models.GPTModel, fp32, vocabulary 1024 so the logits stay small), TP ranks forked on the CPU
(gloo, one thread each). Every mode is built from the same weights; a round times one forward + backward of
one micro-batch per mode, modes interleaved, so a slower moment of a shared machine hits them all; the
fastest round is reported, the median beside it (the first round is warm-up), and the median CPU time of the
rank's process (its compute and copies, not the time it waits for another process to get a core: the figure
that a loaded machine disturbs least). Bytes: what the first forward saved for
backward per layer (saved-tensor hooks, unique storages, parameters excluded), checked against
mpzero.activations.formula. Ratios are to no recomputation in the same run. The budget table comes from the
formula (equal to the counted bytes, tests/test_activation_memory.py): the whole micro-batch, embedding and
loss included.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from mpzero.activations import SavedBytesCounter, activation_formula
from mpzero.models import GPTConfig, GPTModel
from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import seed_everything
from tests.distributed import run_ranks

FULL = dict(recompute_granularity="full")


def modes(num_layers: int, tp: int) -> dict[str, dict]:
    table = {"none": {}, "selective": dict(recompute_activations=True), "full uniform 1": FULL,
             f"full block {num_layers // 2}": dict(FULL, recompute_method="block", recompute_num_layers=num_layers // 2)}
    if tp > 1:
        table.update({"full + distributed": dict(FULL, distribute_saved_activations=True),
                      "SP": dict(sequence_parallel=True), "SP + selective": dict(sequence_parallel=True,
                                                                                 recompute_activations=True),
                      "SP + full": dict(FULL, sequence_parallel=True)})
    return table


def _selected(args) -> dict[str, dict]:
    table = modes(args.num_layers, args.tp)
    return {name: table[name] for name in args.modes} if args.modes else table


def _rank(args):
    groups = init_parallel(args.tp)
    base = GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.heads,
                     vocab_size=1024, max_position_embeddings=args.seq_length, seq_length=args.seq_length,
                     hidden_dropout=args.dropout, attention_dropout=args.dropout)
    tokens = torch.randint(0, 1024, (args.micro_batch_size, args.seq_length + 1),
                           generator=torch.Generator().manual_seed(0))
    built, bytes_, times, cpu = {}, {}, {}, {}
    for name, change in _selected(args).items():
        config = dataclasses.replace(base, **change)
        rng = seed_everything(1, groups.tp_rank, groups.device)
        built[name] = (GPTModel(config, groups.tp, rng), config)
        times[name], cpu[name] = [], []
    for round_ in range(args.rounds + 1):
        for name, (model, config) in built.items():
            counter = SavedBytesCounter(model) if round_ == 0 else None
            model.zero_grad(set_to_none=True)
            torch.distributed.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            if counter is not None:
                with counter.counting():
                    loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
            else:
                loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
            loss.backward()
            torch.distributed.barrier()
            if counter is None:
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
            else:
                formula = activation_formula(model.activation_setting(args.micro_batch_size, args.seq_length,
                                                                      torch.float32, groups.device))
                layers = counter.layer_bytes(config.num_layers)
                bytes_[name] = (sum(layers) / len(layers), counter.total_bytes,
                                layers == formula.layer_bytes and counter.total_bytes == formula.micro_batch_bytes)
    return {name: (bytes_[name], min(times[name]), statistics.median(times[name]), statistics.median(cpu[name]))
            for name in built}


def budget_table(args) -> list[tuple[str, int, int]]:
    """(mode, largest micro-batch at --seq-length, largest sequence at micro-batch 1) within the budget."""
    budget = args.budget_mib * 2 ** 20
    base = GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.heads,
                     vocab_size=1024, max_position_embeddings=1 << 20, hidden_dropout=args.dropout,
                     attention_dropout=args.dropout)
    rows = []
    for name, change in _selected(args).items():
        config = dataclasses.replace(base, **change)

        def fits(b, s):
            setting = dataclasses.replace(config, seq_length=s).activation_setting(args.tp, b, s, torch.float32)
            return activation_formula(setting).micro_batch_bytes <= budget
        best_b = _largest(lambda b: fits(b, args.seq_length))
        step = 64  # sequences in multiples of 64 (divisible by TP for SP)
        best_s = step * _largest(lambda k: fits(1, step * k))
        rows.append((name, best_b, best_s))
    return rows


def _largest(fits) -> int:
    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--budget-mib", type=float, default=512)
    p.add_argument("--modes", nargs="+", default=None, help="a subset of the modes, by name (\"none\" first)")
    args = p.parse_args(argv)
    results = run_ranks(args.tp, _rank, args, deadline=3600)[0]
    print(f"GPT h {args.hidden_size} s {args.seq_length} a {args.heads} L {args.num_layers} b "
          f"{args.micro_batch_size}, TP {args.tp} on {args.tp} CPU ranks (1 thread each), fp32, dropout "
          f"{args.dropout}; forward+backward of one micro-batch, fastest (median) of {args.rounds} rounds; "
          f"rank 0's bytes")
    print("| mode | bytes per layer | vs none | micro-batch bytes | = formula | step ms, fastest (median) | vs none "
          "| CPU ms | vs none |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|")
    (none_layer, _, _), none_best, none_median, none_cpu = results["none"]
    for name, ((layer, total, equal), best, median, cpu) in results.items():
        print(f"| {name} | {layer:,.0f} | {layer / none_layer:.2f}x | {total:,} | {'yes' if equal else 'NO'} | "
              f"{best * 1e3:.0f} ({median * 1e3:.0f}) | {best / none_best:.2f}x ({median / none_median:.2f}x) | "
              f"{cpu * 1e3:.0f} | {cpu / none_cpu:.2f}x |")
    print(f"\nlargest micro-batch (at s {args.seq_length}) and sequence (at b 1, multiples of 64) within "
          f"{args.budget_mib:g} MiB of activations per rank (whole micro-batch, by formula)")
    print("| mode | micro-batch | sequence |")
    print("|---|---:|---:|")
    for name, b, s in budget_table(args):
        print(f"| {name} | {b} | {s} |")


if __name__ == "__main__":
    main()
