"""The pipeline planner against published layouts (issue 43's benchmark, planner part; not a test).

Part 1, PTD-P's Table 1 (Narayanan et al., SC21: 1.7B to 1T on A100-80GB, the paper's TP x PP, GPUs and batch,
sequence 2048, vocabulary 51200): each row's layout evaluated by the planner (micro-batch 1, full recomputation of
every layer as PTD-P ran, bf16 for their fp16, the interleaved schedule with 2 chunks per rank where the layers
allow it (the 530B row's 3 layers a rank: 3 chunks), ZeRO-0 as the paper (no sharded optimizer) and ZeRO-1
(Megatron's distributed optimizer today)): does it fit 80 GiB (2 GiB kept free), which pipeline rank is the
largest, and the cost model's TFLOP/s per GPU beside the paper's. Then a dry run of every row at ZeRO-1 on the real
code for the planner's largest pipeline rank (TP rank 0, DP rank 0), and of the 1T row's rank 3000 (pipeline rank
62): every figure `equal`.

Part 2, PTD-P's Table 2 (175B, batch 1536 [recalled]: PTD-P's model-parallel size 96 = TP 8 x PP 12 [recalled]
against ZeRO-3 without model parallelism): the cost model's TFLOP/s per GPU for TP 8 x PP 12 x ZeRO-1 and for
ZeRO-3 alone, on 384 and 1536 A100s, beside the paper's 153 vs 144 and 141 vs 44. A model (FLOPs at a fixed
fraction of the peak, communication at stated bandwidths: one 200 Gb/s NIC per GPU, NVLink 150 GB/s), stated as
one; both layouts dry-run `equal` on 1536 ranks.

Part 3, uneven stages (Megatron-Bridge #5077: Megatron's estimator divides the layers evenly and was 31.8% low
on the heaviest stage of an 8-layer [1, 2, 2, 3] split): the same split of a small GPT at PP 4, each stage's
model states and activations (one micro-batch, and the micro-batches in flight) as the dry run prints them
(counted = formula on every line), beside the even split's figures.

    python bench/bench_pipeline_planner.py [--part 1 2 3] [--no-dry-run] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from mpzero.cli.arguments import parse_args, planner_sections  # noqa: E402
from mpzero.planner.cost import Hardware  # noqa: E402
from mpzero.planner.plan import Layout, Machine, Planner  # noqa: E402

GIB = 2 ** 30
A100 = Hardware(device_tflops=312.0, efficiency=0.5, dp_bandwidth=25e9, tp_bandwidth=150e9, pp_bandwidth=25e9)
# PTD-P Table 1: params, heads, hidden, layers, TP, PP, GPUs, batch, TF/GPU (PARALLELISM.md 1.2)
TABLE1 = [("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137), ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
          ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138), ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
          ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155), ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
          ("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163)]
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]


def model_flags(heads: int, hidden: int, layers: int, batch: int) -> list[str]:
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", "2048", "--vocab-size", "51200", "--micro-batch-size", "1", "--global-batch-size",
            str(batch), "--bf16", "--train-iters", "1", "--lr", "1e-4", "--mock-data"]


def ptdp_flops(batch: int, layers: int, hidden: int, seq: int = 2048, vocab: int = 51200) -> float:
    """PTD-P's FLOPs per iteration (their eq. 3, with the recomputation's forward): 96 B s l h^2 (1 + s/(6h) +
    V/(16 l h))."""
    return 96 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def chunks(layers: int, pp: int) -> int:
    """Chunks per rank for the interleaved schedule: 2 where the rank's layers split in two, else all of them."""
    per_rank = layers // pp
    return 1 if pp == 1 else 2 if per_rank % 2 == 0 else per_rank


def layout_flags(layout: Layout) -> list[str]:
    flags = ["--tensor-model-parallel-size", str(layout.tp), "--zero-stage", str(layout.stage)] + FULL
    if layout.pp > 1:
        flags += ["--pipeline-model-parallel-size", str(layout.pp)]
    if layout.virtual_stages > 1:
        flags += ["--num-virtual-stages-per-pipeline-rank", str(layout.virtual_stages)]
    return flags


def evaluate(flags: list[str], world: int, layout: Layout):
    machine = Machine(world, 80 * GIB, None, None, 2 * GIB, True, A100)
    return Planner(planner_sections(parse_args(flags), 51200), machine).evaluate(layout)


def dry_run(flags: list[str], world: int, rank: int) -> dict:
    """pretrain_gpt.py --dry-run in a process of its own: the `planner |` verdict and the lines it printed."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *flags, "--dry-run", "--world-size",
                          str(world), "--rank", str(rank)], cwd=ROOT, capture_output=True, text=True)
    lines = out.stdout.splitlines()
    verdict = [line for line in lines if line.startswith("planner |")]
    return {"rank": rank, "equal": bool(verdict) and verdict[0].endswith("| equal"), "code": out.returncode,
            "planner": verdict[0] if verdict else out.stderr[-500:], "seconds": time.perf_counter() - start,
            "lines": [line for line in lines if line.startswith(("dry run:", "zero memory", "pipeline comm",
                                                                 "activation memory"))]}


def part1(args) -> list[dict]:
    rows = []
    for name, heads, hidden, layers, tp, pp, gpus, batch, paper in TABLE1:
        dp, flags = gpus // (tp * pp), model_flags(heads, hidden, layers, batch)
        row = {"model": name, "tp": tp, "pp": pp, "dp": dp, "gpus": gpus, "batch": batch, "paper_tflops": paper}
        for stage in (0, 1):
            layout = Layout(tp, dp, stage, 1, batch, recompute="full", pp=pp, virtual_stages=chunks(layers, pp))
            plan = evaluate(flags + FULL, gpus, layout)
            estimate = ptdp_flops(batch, layers, hidden) / (plan.cost.seconds * gpus) / 1e12
            row[f"zero{stage}"] = {"fits": plan.fits, "peak_gib": plan.device_peak / GIB, "pp_rank": plan.pp_rank,
                                   "min_stage_gib": min(plan.stage_peaks) / GIB, "states_gib": plan.states.device / GIB,
                                   "activations_gib": plan.activations.peak / GIB, "tflops": estimate,
                                   "bubble": plan.cost.bubble, "seconds": plan.cost.seconds,
                                   "layout": layout.describe()}
            if stage == 1 and not args.no_dry_run:
                ranks = [plan.pp_rank * tp * dp] + ([3000] if name == "1008.0B" else [])
                row["dry_runs"] = [dry_run(flags + layout_flags(layout), gpus, rank) for rank in ranks]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "dry_runs"}), flush=True)
        for run in row.get("dry_runs", []):
            print(f"  dry run rank {run['rank']}: {'equal' if run['equal'] else 'DIFFERENT'} ({run['seconds']:.0f} s) "
                  f"{run['lines'][0] if run['lines'] else run['planner']}", flush=True)
    return rows


def part2(args) -> list[dict]:
    heads, hidden, layers, batch = 96, 12288, 96, 1536
    flags = model_flags(heads, hidden, layers, batch)
    rows = []
    for gpus, paper in ((384, {"ptd-p": 153, "zero-3": 144}), (1536, {"ptd-p": 141, "zero-3": 44})):
        for name, layout in (("ptd-p", Layout(8, gpus // 96, 1, 1, batch, recompute="full", pp=12, virtual_stages=2)),
                             ("zero-3", Layout(1, gpus, 3, batch // gpus, batch, recompute="full"))):
            plan = evaluate(flags + FULL, gpus, layout)
            cost = plan.cost
            row = {"gpus": gpus, "layout": layout.describe(), "name": name, "fits": plan.fits,
                   "peak_gib": plan.device_peak / GIB, "paper_tflops": paper[name],
                   "tflops": ptdp_flops(batch, layers, hidden) / (cost.seconds * gpus) / 1e12,
                   "seconds": cost.seconds, "compute": cost.compute, "bubble": cost.bubble, "dp": cost.dp,
                   "tp": cost.tp, "pp": cost.pp, "dp_gb": plan.states.comm_bytes / 1e9}
            if gpus == 1536 and not args.no_dry_run:
                model = model_flags(heads, hidden, layers, batch)
                model[model.index("--micro-batch-size") + 1] = str(layout.micro_batch)
                row["dry_run"] = dry_run(model + layout_flags(layout), gpus, plan.pp_rank * layout.tp * layout.dp)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "dry_run"}), flush=True)
            if "dry_run" in row:
                print(f"  dry run rank {row['dry_run']['rank']}: "
                      f"{'equal' if row['dry_run']['equal'] else 'DIFFERENT'} ({row['dry_run']['seconds']:.0f} s)",
                      flush=True)
    return rows


SMALL = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--vocab-size", "1000", "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16", "--train-iters",
         "1", "--lr", "1e-4", "--mock-data", "--pipeline-model-parallel-size", "4", "--zero-stage", "1"]
UNEVEN = ["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "3"]


def _figures(run: dict) -> dict:
    memory = next(line for line in run["lines"] if line.startswith("zero memory"))
    activation = next(line for line in run["lines"] if line.startswith("activation memory"))
    return {"params": int(re.search(r"params (\d+)", memory).group(1)),
            "state_bytes": int(re.search(r"measured bytes (\d+)", memory).group(1)),
            "micro_batch": int(re.search(r"micro-batch ([\d,]+) B counted", activation).group(1).replace(",", "")),
            "in_flight": int(re.search(r"\| ([\d,]+) B counted", activation.split("in flight")[1]).group(1)
                             .replace(",", "")),
            "ratios": sorted(set(re.findall(r"ratio (\d\.\d+)", memory + " | " + activation))),
            "equal": run["equal"]}


def part3(args) -> dict:
    out = {}
    for name, flags in (("even [2, 2, 2, 2]", []), ("uneven [1, 2, 2, 3]", UNEVEN)):
        out[name] = [dict(_figures(dry_run(SMALL + flags, 4, rank)), stage=rank) for rank in range(4)]
        for stage in out[name]:
            print(f"{name} stage {stage['stage']}: {json.dumps(stage)}", flush=True)
    uneven = out["uneven [1, 2, 2, 3]"]
    heaviest = max(uneven, key=lambda s: s["params"])
    even_split = sum(s["params"] for s in uneven) / 4
    out["even split of the uneven model's parameters"] = {"per stage": even_split, "heaviest": heaviest["params"],
                                                         "low by": 1 - even_split / heaviest["params"]}
    layer = out["even [2, 2, 2, 2]"][1]["micro_batch"] // 2  # a middle stage keeps its layers only
    held = max(uneven, key=lambda s: s["in_flight"])
    out["even split of the activations"] = {  # Megatron's first-stage figure: L/p layers x p in flight, no ends
        "L layers' worth": 8 * layer, "stage 0 in flight": uneven[0]["in_flight"],
        "heaviest in flight": held["in_flight"], "heaviest stage": held["stage"]}
    for key in ("even split of the uneven model's parameters", "even split of the activations"):
        print(key, json.dumps(out[key]), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    parser.add_argument("--no-dry-run", action="store_true", help="the planner's figures only")
    parser.add_argument("--json", default=None, help="write every figure here")
    args = parser.parse_args()
    results = {}
    for part, run in ((1, part1), (2, part2), (3, part3)):
        if part in args.part:
            print(f"--- part {part}", flush=True)
            results[f"part{part}"] = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
