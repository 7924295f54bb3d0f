"""The parts of the check and its Markdown report: built from plain dicts, validated, written atomically.

A part's result: {"name", "status" ("pass" | "fail" | "timeout" | "skipped: <why>" | "error: <why>"),
"seconds", "limit_s", "logs": [paths], "columns": [...], "rows": [{column: value}], "notes": [...]}.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from mpzero.files import write_atomically

REPORT_NAME = "report.md"
JSON_NAME = "report.json"
TITLE = "# mpzero GPU check"


@dataclass(frozen=True)
class Part:
    name: str
    title: str
    limit_s: int  # the part's own time limit (seconds); the check's total budget may cut it shorter
    what: str


PARTS = [
    Part("fused_kernels", "Fused Triton kernels against their references", 150,
         "pytest tests/fused (LayerNorm, RMSNorm, scaled masked softmax, AdamW, the fused cross entropy; "
         "fp32/fp16/bf16; forward and backward; "
         "GPT-2 and edge shapes) on the GPU"),
    Part("gpt_cuda_vs_cpu", "GPT forward/backward: CUDA against CPU; CUDA graphs against --torch-compile", 150,
         "pytest tests/gpu/test_gpt_cuda.py: same weights and tokens on both devices, fp32; auto, local attention "
         "with the Triton kernels and with the references, flash; --cuda-graph-impl local's ZeRO-1 bf16 steps "
         "(LLaMA-shaped, an evaluation between them) against --torch-compile's, and its CUDA graph launches; "
         "tests/gpu/test_moe_cuda.py: a GPT of routed experts against the CPU, torch._grouped_mm against the "
         "per-expert loop in bf16 and fp32"),
    Part("zero_nccl", "ZeRO stages 0-3 over NCCL, world of one", 120,
         "pytest tests/gpu/test_zero_nccl.py: pretrain_gpt.main at every stage, losses equal across stages"),
    Part("mixed_precision", "fp16 dynamic loss scaling and bf16, 20 steps", 90,
         "pytest tests/gpu/test_mixed_precision.py: losses finite and decreasing, MFU in the log; --profile's "
         "torch.profiler and Nsight Systems modes"),
    Part("checkpoint_resume", "Checkpoint saved on GPU reloads and resumes bitwise", 120,
         "pytest tests/gpu/test_checkpoint_resume.py: --save/--exit-interval then --load, losses compared"),
    Part("offload", "ZeRO-Offload tiers on the GPU: optimizer (and stage-3 parameters) in host memory and on disk",
         120, "pytest tests/gpu/test_offload_cuda.py: losses against the in-memory run, device/host/disk bytes and "
              "device<->host traffic against their formulas"),
    Part("multi_gpu", "torchrun over every GPU: TP and DP layouts against one GPU", 180,
         "torchrun pretrain_gpt (TP 2 x DP 2 when 4+ GPUs, else TP 2 and DP 2 apart), stages 1-3"),
    Part("bench_gpt2", "GPT-2 124M training step: mpzero against nanoGPT-style eager and torch.compile", 300,
         "bf16, seq 1024: tokens/s, peak memory, MFU against the bf16 matmul peak measured in the same run and "
         "against the GPU's datasheet peak; then, with time left, the goal's variants in interleaved rounds"),
    Part("bench_kernels", "Triton kernels against eager PyTorch and torch.compile at GPT-2 shapes", 150,
         "bench/bench_fused_gpu.py --gpt2 (triton.testing.do_bench medians)"),
    Part("zero_memory", "ZeRO memory line against torch.cuda.max_memory_allocated", 90,
         "GPT-2 124M, bf16, stages 0-3: bytes the `zero memory` line predicts and counts, against the allocator"),
    Part("bench_fp8", "FP8 through torchao on a LLaMA-shaped ~1B model against bf16", 300,
         "bf16 and each torchao recipe (tensorwise, rowwise, rowwise_with_gw_hp), --torch-compile, ZeRO-1, the step "
         "launched with no host sync: tokens/s and its ratio to bf16, MFU, peak memory, host syncs per step, the "
         "loss after 100 steps against bf16's"),
]
PART_NAMES = [p.name for p in PARTS]
STATUSES = ("pass", "fail", "timeout", "skipped", "error")


def status_kind(status: str) -> str:
    """'pass', 'fail', 'timeout', 'skipped' or 'error' for a status string ('skipped: no CUDA' -> 'skipped')."""
    kind = status.split(":", 1)[0].strip()
    if kind not in STATUSES:
        raise ValueError(f"unknown status {status!r}: expected one of {STATUSES} (optionally ': why')")
    return kind


def skipped_results(why: str) -> list[dict]:
    return [{"name": p.name, "status": f"skipped: {why}", "seconds": 0.0, "limit_s": p.limit_s, "logs": [],
             "columns": [], "rows": [], "notes": []} for p in PARTS]


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        text = f"{value:.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(columns: list[str], rows: list[dict]) -> list[str]:
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return lines


def render(environment: dict, results: list[dict], total_seconds: float, out_dir: str) -> str:
    """The Markdown report: environment, a summary table, then one section (and table) per part."""
    by_name = {r["name"]: r for r in results}
    lines = [TITLE, ""]
    lines += ["| environment | |", "|---|---|"]
    lines += [f"| {_cell(k)} | {_cell(v)} |" for k, v in environment.items()]
    lines += ["", f"Total wall time {total_seconds:.0f} s. Raw logs: `{out_dir}/logs/`.", "", "## Summary", ""]
    summary = [{"part": p.name, "status": by_name[p.name]["status"], "seconds": round(by_name[p.name]["seconds"], 1),
                "limit s": by_name[p.name]["limit_s"]} for p in PARTS]
    lines += _table(["part", "status", "seconds", "limit s"], summary)
    for part in PARTS:
        r = by_name[part.name]
        lines += ["", f"## {part.name}: {part.title}", "", part.what + ".", "",
                  f"- status: **{r['status']}**", f"- time: {r['seconds']:.1f} s (limit {r['limit_s']} s)",
                  "- raw logs: " + (", ".join(f"`{p}`" for p in r["logs"]) or "none")]
        lines += [f"- {note}" for note in r.get("notes", [])]
        if r.get("rows"):
            lines += [""] + _table(r["columns"] or sorted({k for row in r["rows"] for k in row}), r["rows"])
    return "\n".join(lines) + "\n"


def validate(text: str, results: list[dict]) -> None:
    """Raise ValueError unless the report names every part once, with a known status, in PARTS order."""
    if not text.startswith(TITLE + "\n"):
        raise ValueError("report does not start with its title")
    names = [r["name"] for r in results]
    if names != PART_NAMES:
        raise ValueError(f"results name parts {names}, expected {PART_NAMES}")
    positions = []
    for part, result in zip(PARTS, results):
        status_kind(result["status"])
        heading = f"\n## {part.name}: {part.title}\n"
        if text.count(heading) != 1:
            raise ValueError(f"part {part.name} has {text.count(heading)} sections in the report, expected 1")
        positions.append(text.index(heading))
        if f"- status: **{result['status']}**" not in text[positions[-1]:]:
            raise ValueError(f"part {part.name}: its status line is missing")
        if f"| {part.name} | {_cell(result['status'])} |" not in text:
            raise ValueError(f"part {part.name} is missing from the summary table")
    if positions != sorted(positions):
        raise ValueError("parts are out of order")


def write(out_dir: str, environment: dict, results: list[dict], total_seconds: float) -> str:
    """Validate, then write report.md and report.json atomically into out_dir; returns report.md's path."""
    text = render(environment, results, total_seconds, out_dir)
    validate(text, results)
    os.makedirs(out_dir, exist_ok=True)
    write_atomically(os.path.join(out_dir, JSON_NAME),
                     json.dumps({"environment": environment, "total_seconds": total_seconds, "parts": results},
                                indent=1, sort_keys=True, default=str) + "\n")
    path = os.path.join(out_dir, REPORT_NAME)
    write_atomically(path, text)
    return path
