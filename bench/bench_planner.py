"""The memory planner at scale and on this CPU (issue 13's benchmark; not a test).

Part 1, "how large?": the largest GPT (head size 128, as many layers as heads: L = a = h/128, ~12h^3/128
parameters; sequence 1024, micro-batch 1, fp16 as in the ZeRO papers, recomputation as the planner picks) that
each published strategy fits on the hardware its paper used (`ROWS`: one V100-32GB, 128 and 400 V100s, 32 DGX-2
nodes, ZeRO-Infinity's NVMe), found by bisection with the planner, beside the published figure; then a dry run of
every cell's model on the real code confirms the planner's figures (a disk tier dry-runs as cpu: the device
bytes are the same, and the dry run writes no files).

Part 2, "does the pick hold?" (MEMORY.md A11): world 4 on this CPU, a per-rank memory budget: the planner's pick
runs 2 steps with measured peak (VmHWM minus the RSS before the model is built, per rank; glibc's mmap threshold
at 64 KiB so freed tensors leave the RSS) <= predicted (device peak + the 32 MiB CPU reserve) <= budget; the fastest
layout it rejects, run anyway, measures above the budget.

    python -m bench.bench_planner                 # both parts, ~5-10 min on 2 cores
    python -m bench.bench_planner --part 2 --budget 160
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import io
import json
import os
import runpy
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch

torch.set_num_threads(1)  # forked ranks below: no OpenMP pool in the parent

from mpzero.cli.arguments import parse_args, planner_sections  # noqa: E402
from mpzero.planner.cost import Hardware  # noqa: E402
from mpzero.planner.plan import Machine, Planner  # noqa: E402

GIB, MIB, TB = 2 ** 30, 2 ** 20, 10 ** 12
DGX2 = {"device": 32 * GIB, "host": 1.5 * 2 ** 40, "disk": 28 * TB, "per_node": 16}  # 16 V100-32GB, NVMe [recalled]
# (hardware, strategy, (stage, optimizer tier, parameter tier), TP sizes tried, published figure and source):
# the hardware and figures of the ZeRO (SC'20), ZeRO-Offload (ATC'21) and ZeRO-Infinity (SC'21) papers and DeepSpeed's
# ZeRO-3 Offload announcement; the DGX-2's NVMe size is an estimate
ROWS = [
    ("1 V100-32GB, 1.5 TB host", 1, {**DGX2, "per_node": 1}, "DP (ZeRO-0)", (0, "none", "none"), [1],
     1.4e9, "PyTorch DDP, ZeRO-Offload paper"),
    ("1 V100-32GB, 1.5 TB host", 1, {**DGX2, "per_node": 1}, "ZeRO-Offload (ZeRO-2, optimizer on CPU)",
     (2, "cpu", "none"), [1], 13e9, "ZeRO-Offload paper"),
    ("1 V100-32GB, 1.5 TB host", 1, {**DGX2, "per_node": 1}, "ZeRO-3 Offload (optimizer and parameters on CPU)",
     (3, "cpu", "cpu"), [1], 40e9, "DeepSpeed ZeRO-3 Offload"),
    ("128 V100-32GB (8 DGX-2), DP only", 128, DGX2, "ZeRO-1", (1, "none", "none"), [1], 6e9, "ZeRO paper"),
    ("128 V100-32GB (8 DGX-2), DP only", 128, DGX2, "ZeRO-2", (2, "none", "none"), [1], 13e9, "ZeRO paper"),
    ("400 V100-32GB (25 DGX-2), TP 16", 400, DGX2, "ZeRO-2", (2, "none", "none"), [16], 170e9, "ZeRO paper"),
    ("512 V100-32GB (32 DGX-2)", 512, DGX2, "ZeRO-3 Offload (optimizer and parameters on CPU)", (3, "cpu", "cpu"),
     [1, 2, 4, 8, 16], 2e12, "DeepSpeed ZeRO-3 Offload"),
    ("1 DGX-2 (16 V100-32GB, NVMe)", 16, DGX2, "ZeRO-Infinity (optimizer and parameters on NVMe)",
     (3, "disk", "disk"), [1, 2, 4, 8, 16], 1e12, "ZeRO-Infinity paper"),
    ("512 V100-32GB (32 DGX-2, NVMe)", 512, DGX2, "ZeRO-Infinity (optimizer and parameters on NVMe)",
     (3, "disk", "disk"), [1, 2, 4, 8, 16], 32e12, "ZeRO-Infinity paper"),
]
SEQ = 1024


def model_flags(heads: int) -> list[str]:
    h = 128 * heads
    return ["--num-layers", str(heads), "--hidden-size", str(h), "--num-attention-heads", str(heads),
            "--seq-length", str(SEQ), "--vocab-size", "50257", "--mock-data", "--micro-batch-size", "1",
            "--train-iters", "1", "--lr", "1e-4", "--fp16"]


def best_plan(heads: int, machine: Machine, stage: int, optimizer: str, params: str, tps):
    """The fastest fitting plan of the model with `heads` heads under the strategy (None: nothing fits), and every
    plan evaluated."""
    planner = Planner(planner_sections(parse_args(model_flags(heads)), 50257), machine)
    plans = []
    for layout in planner.layouts(tps=tps, stages=[stage], micro_batches=[1]):
        if (layout.offload_optimizer, layout.offload_params) == (optimizer, params):
            plans.append(planner.evaluate(layout))
    fitting = [p for p in plans if p.fits]
    return (max(fitting, key=lambda p: p.cost.tokens_per_second) if fitting else None), plans


def step_of(tps) -> int:
    """Head counts tried: multiples of the TP size when the row fixes one (each TP rank owns whole heads)."""
    return tps[0] if len(tps) == 1 else 1


def largest(machine: Machine, strategy, tps) -> tuple[int, object]:
    """Bisection on the head count (up to 8192): the largest model that fits."""
    step = step_of(tps)

    def fits(k):
        return best_plan(k * step, machine, *strategy, tps)[0]
    lo, hi = 0, max(8 // step, 1)
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi * step > 8192:
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step, (fits(lo) if lo else None)


def limit(heads: int, machine: Machine, strategy, tps, found) -> str:
    """What stops the next size up (by the found layout's TP size, so that it can split the heads): the largest
    term over its budget in the least demanding layout."""
    _, plans = best_plan(heads + (found.layout.tp if found else step_of(tps)), machine, *strategy, tps)
    closest = min(plans, key=lambda p: p.device_peak)
    if closest.device_peak + machine.device_reserve > machine.device_memory:
        terms = {"backward": closest.backward_peak, "optimizer step": closest.step_peak,
                 "construction": closest.construction}
        return max(terms, key=terms.get)
    return closest.why or "host"


def params_of(heads: int) -> int:
    from mpzero.cli.arguments import gpt_config
    from mpzero.planner.shapes import model_shapes
    return model_shapes(gpt_config(parse_args(model_flags(heads)), 50257), 1).numel


def part1(args) -> dict:
    rows = {}
    for hardware, world, spec, strategy, tiers, tps, published, source in ROWS:
        machine = Machine(world, spec["device"], spec["host"], spec["disk"], 2 * GIB, True,
                          Hardware(gpus_per_node=min(spec["per_node"], world)))
        start = time.perf_counter()
        heads, plan = largest(machine, tiers, tps)
        params = params_of(heads) if heads else 0
        row = {"hardware": hardware, "world": world, "strategy": strategy, "heads": heads, "params": params,
               "plan": plan, "layout": plan.layout.describe() if plan else None,
               "limited_by": limit(heads, machine, tiers, tps, plan), "published": published, "source": source,
               "device_peak": plan.device_peak if plan else None, "construction": plan.construction if plan else None,
               "host_per_node": plan.host_per_node if plan else None, "seconds": time.perf_counter() - start}
        rows[f"{hardware} | {strategy}"] = row
        print(f"{hardware} | {strategy}: {params / 1e9:.1f}B ({row['layout']}; limit: {row['limited_by']}) | "
              f"published {published / 1e9:g}B ({source}) | {'at or above' if params >= published else 'BELOW'}",
              flush=True)
    return rows


DRY = """
import contextlib, io, json, sys, time
import pretrain_gpt
out = io.StringIO()
start = time.perf_counter()
with contextlib.redirect_stdout(out):
    pretrain_gpt.main(sys.argv[1:])
print(json.dumps({"stdout": out.getvalue(), "seconds": time.perf_counter() - start}))
"""


def confirm(heads: int, layout, world: int, timeout: int) -> dict:
    """A dry run of rank 0 of that layout: the planner line says whether every figure is equal."""
    flags = model_flags(heads) + ["--tensor-model-parallel-size", str(layout.tp), "--zero-stage", str(layout.stage),
                                  "--global-batch-size", str(layout.global_batch)]
    if layout.recompute == "full":
        flags += ["--recompute-granularity", "full"]
    elif layout.recompute == "selective":
        flags += ["--recompute-granularity", "selective"]
    if layout.sequence_parallel:
        flags += ["--sequence-parallel"]
    if layout.units != "layer":
        flags += ["--zero-units", layout.units]
    if layout.offload_optimizer != "none":  # the dry run keeps the disk tier in memory: cpu, the same device bytes
        flags += ["--offload-optimizer", layout.offload_optimizer.replace("disk", "cpu"),
                  "--offload-params", layout.offload_params.replace("disk", "cpu")]
    flags += ["--dry-run", "--world-size", str(world), "--rank", "0"]
    try:
        done = subprocess.run([sys.executable, "-c", DRY, *flags], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"equal": None, "why": f"over {timeout} s"}
    if done.returncode:
        return {"equal": None, "why": done.stderr.strip().splitlines()[-1][:300]}
    result = json.loads(done.stdout.splitlines()[-1])
    planner_line = next(line for line in result["stdout"].splitlines() if line.startswith("planner |"))
    return {"equal": planner_line.endswith("| equal"), "planner_line": planner_line, "seconds": result["seconds"]}


# --- part 2 ----------------------------------------------------------------------------------------------------

CPU_MODEL = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "64",
             "--vocab-size", "32000", "--mock-data", "--train-iters", "2", "--lr", "1e-4", "--bf16",
             "--global-batch-size", "16"]


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _measure_rank(argv: list[str]) -> tuple[int, int]:
    """(peak RSS growth, file-backed RSS growth) of this rank over 2 training steps, from just before the model is
    built. The file-backed part is the libraries' code the run pages in (RssFile): kernels first used by its
    forward, backward and step; the rest is anonymous memory (tensors, allocator and interpreter slack)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: larger allocations are mmapped and unmapped when freed
    libc.mallopt(-1, 64 * 1024)  # M_TRIM_THRESHOLD
    import pretrain_gpt
    from mpzero.cli.arguments import run_config
    from mpzero.parallel import init_parallel
    from mpzero.training import build_training_state, forward_backward
    from mpzero.training.mock_data import MockGPTDataset
    args = parse_args(argv)
    groups = init_parallel(args.tensor_model_parallel_size)
    run = run_config(args, groups.world.size)
    data = MockGPTDataset(run.data.vocab_size, run.training.seq_length, 1, 2 * run.training.global_batch_size)
    before, file_before = _status("VmRSS"), _status("RssFile")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    state = build_training_state(run, pretrain_gpt.gpt_provider, groups)
    for step in range(2):
        forward_backward(state, data, step * run.training.global_batch_size, run.training)
        state.optimizer.step(1e-4)
    state.optimizer.close()
    return _status("VmHWM") - before, _status("RssFile") - file_before


def part2(args) -> dict:
    from tests.distributed import run_ranks
    tool = runpy.run_path(os.path.join(ROOT, "tools", "plan_memory.py"))
    budget = args.budget * MIB
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = tool["main"](["--world-size", "4", "--device", "cpu", "--device-memory", f"{args.budget}MiB", "--json",
                             "--micro-batch-sizes", "1,2,4", "--offload-tiers", "none", *CPU_MODEL])
    assert code == 0, out.getvalue()
    plan = json.loads(out.getvalue())
    reserve = plan["machine"]["device_reserve"]
    best = plan["best"]
    rejected = next(x for x in sorted((x for x in plan["layouts"] if not x["fits"]),
                                      key=lambda x: -x["tokens_per_s"]))
    results = {}
    for name, choice in (("picked", best), ("rejected", rejected)):
        lay = choice["layout"]
        flags = CPU_MODEL + ["--tensor-model-parallel-size", str(lay["tp"]), "--zero-stage", str(lay["stage"]),
                             "--micro-batch-size", str(lay["micro_batch"])]
        if lay["recompute"] != "none":
            flags += ["--recompute-granularity", lay["recompute"]]
        if lay["sequence_parallel"]:
            flags += ["--sequence-parallel"]
        start = time.perf_counter()
        measured, code = zip(*run_ranks(4, _measure_rank, flags, deadline=1800))
        predicted = choice["bytes_per_rank"]["device peak"] + reserve
        results[name] = {"layout": lay, "measured": list(measured), "code_pages": list(code),
                         "predicted": predicted, "seconds": time.perf_counter() - start}
        print(f"{name}: {json.dumps(lay)} measured MiB per rank {[round(m / MIB, 1) for m in measured]} (of which "
              f"code paged in {[round(c / MIB, 1) for c in code]}) | predicted {predicted / MIB:.1f} (device peak "
              f"{(predicted - reserve) / MIB:.1f} + {reserve / MIB:.0f} reserve) | budget {budget / MIB:.0f}",
              flush=True)
    ok_pick = max(results["picked"]["measured"]) <= results["picked"]["predicted"] <= budget
    ok_reject = max(results["rejected"]["measured"]) > budget
    print(f"picked: measured <= predicted <= budget: {ok_pick}; rejected, run anyway: measured > budget: {ok_reject}")
    return {"budget": budget, "results": results, "pick_holds": ok_pick, "reject_holds": ok_reject}


def _describe(o) -> str:
    return o.layout.describe() if hasattr(o, "layout") else str(o)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", type=int, choices=(1, 2), default=None)
    parser.add_argument("--budget", type=int, default=140, help="part 2: MiB per rank")
    parser.add_argument("--confirm-timeout", type=int, default=600, help="part 1: seconds per confirming dry run")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    results = {}
    if args.part in (None, 1):
        results["part1"] = part1(args)
        confirmations = {}
        for key, row in results["part1"].items():
            if row["heads"]:
                confirmations[key] = confirm(row["heads"], row["plan"].layout, row["world"], args.confirm_timeout)
                print(f"dry run of {key} ({row['params'] / 1e9:.1f}B, {row['layout']}): {confirmations[key]}",
                      flush=True)
        results["confirmations"] = confirmations
    if args.part in (None, 2):
        results["part2"] = part2(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=_describe)


if __name__ == "__main__":
    main()
