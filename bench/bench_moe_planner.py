"""The planner's rows for the published MoE layouts (`mpzero.planner.published.PUBLISHED_MOE`: Mixtral 8x7B at
Megatron's TP 1 x PP 4 x EP 8, a DeepSeek-V3-sized MoE at DeepSeek's PP 16 x EP 64 with ZeRO-1, Qwen3-30B-A3B at
Megatron-Bridge's TP 4 x PP 2 x EP 4), on H100-80GB (989 TF/s dense bf16): the device peak of the largest pipeline
rank with the activations planned at the dropless worst case and at balanced routing, the EP, DP and pipeline
bytes, the cost model's seconds per iteration; then `pretrain_gpt.py --dry-run` of each row's listed ranks (one
process each), whose `planner |` line must say `equal`, with its time and peak RSS.

    python bench/bench_moe_planner.py               # about 2 minutes on a 2-core machine
    python bench/bench_moe_planner.py --no-dry-run  # the planner's figures alone, about 1 minute
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mpzero.planner.published import PUBLISHED_MOE  # noqa: E402
from tools import plan_memory  # noqa: E402

GIB = 2 ** 30
MACHINE = ["--device-memory", "80", "--device-tflops", "989", "--zero-bubble", "no"]
RUN = ["--train-iters", "1", "--lr", "1e-4", "--mock-data"]


def planned(row, routing: str) -> dict:
    """The planner's best layout (JSON) for the row at its layout, activations at `routing`."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        plan_memory.plan(["--world-size", str(row.world), "--json", "--moe-plan-routing", routing] + MACHINE
                         + list(row.model) + list(row.layout))
    result = json.loads(out.getvalue())
    return result["best"] or min(result["layouts"], key=lambda x: x["bytes_per_rank"]["device peak"])


def dry_run(row, rank: int) -> str:
    """The dry run of `rank`: its `planner |` verdict, seconds and peak RSS."""
    argv = [sys.executable, str(ROOT / "pretrain_gpt.py"), "--dry-run", "--world-size", str(row.world), "--rank",
            str(rank)] + list(row.model) + list(row.layout) + RUN
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, check=False).stdout
    verdict = "equal" if re.search(r"^planner \|.*\| equal$", out, re.M) else "DIFFERENT"
    timing = re.search(r"^dry run \| peak RSS (\d+) MiB \| ([\d.]+) s", out, re.M)
    return f"rank {rank} {verdict}" + (f" ({timing[2]} s, {timing[1]} MiB)" if timing else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-dry-run", action="store_true")
    opts = p.parse_args(argv)
    print("| model | layout (GPUs) | device peak, worst / balanced (GiB) | activations at the peak, worst / balanced (GiB) | "
          "EP GB/it | DP GB/it | PP GB/it | s/iter | dry run |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in PUBLISHED_MOE:
        worst, balanced = planned(row, "worst"), planned(row, "balanced")
        lay = worst["layout"]
        layout = (f"TP {lay['tp']} x PP {lay['pp']} x DP {lay['dp']}, EP {lay['ep']}, ZeRO-{lay['stage']}, "
                  f"recompute {lay['recompute']} ({row.world})")
        peaks = (f"{worst['bytes_per_rank']['device peak'] / GIB:.1f} / "
                 f"{balanced['bytes_per_rank']['device peak'] / GIB:.1f}")
        acts = (f"{worst['bytes_per_rank']['activations'] / GIB:.2f} / "
                f"{balanced['bytes_per_rank']['activations'] / GIB:.2f}")
        dry = "-" if opts.no_dry_run else ", ".join(dry_run(row, rank) for rank in row.ranks)
        print(f"| {row.name} | {layout} | {peaks} | {acts} | {worst['ep_bytes_per_iter_balanced'] / 1e9:.1f} | "
              f"{worst['dp_bytes_per_iter'] / 1e9:.2f} | {worst['pp_bytes_per_iter'] / 1e9:.2f} | "
              f"{worst['seconds_per_iter']:.2f} | {dry} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
