"""The parts of `make gpu-check` that are not pytest files, one per process:

    python3 -m tests.gpu.check.workers {environment,multi_gpu,bench_gpt2,zero_memory,bench_fp8} --json PATH [--limit S]

Each writes its JSON result (tests/gpu/check/result.py) after every row, atomically, so a part killed at its time
limit still leaves the rows it finished: environment and multi_gpu here, bench_gpt2 in gpt2_step.py, zero_memory in
memory_check.py, bench_fp8 in fp8_bench.py. Every row is tried on its own: an exception is
that row's error, and the remaining rows still run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

from mpzero.files import write_atomically
from tests.gpu.check.fp8_bench import bench_fp8, torchao_version
from tests.gpu.check.gpt2_step import bench_gpt2
from tests.gpu.check.memory_check import zero_memory
from tests.gpu.check.result import Result, error_text


# -- environment ---------------------------------------------------------------------------------------------
def environment(args) -> int:
    info = {"python": sys.version.split()[0], "platform": platform.platform(), "cuda": False}
    try:
        import torch
    except Exception as error:  # noqa: BLE001 - no torch (or a broken one) is an answer, not a crash
        info["torch"] = f"not importable ({type(error).__name__}: {error})"
        write_atomically(args.json, json.dumps(info) + "\n")
        return 0
    info["torch"] = torch.__version__
    info["torch CUDA"] = str(torch.version.cuda)
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception as error:  # noqa: BLE001
        info["triton"] = f"not importable ({type(error).__name__})"
    try:
        import numpy
        info["numpy"] = numpy.__version__
    except Exception:  # noqa: BLE001
        info["numpy"] = "not importable"
    info["torchao"] = torchao_version() or "not installed (bench_fp8 skips; make gpu-wheels)"
    info["cuda"] = bool(torch.cuda.is_available())
    info["device_count"] = torch.cuda.device_count() if info["cuda"] else 0
    if info["cuda"]:
        names = [torch.cuda.get_device_name(i) for i in range(info["device_count"])]
        info["device"] = ", ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names))
        props = torch.cuda.get_device_properties(0)
        info["compute capability"] = f"{props.major}.{props.minor}"
        info["GPU memory (GiB)"] = round(props.total_memory / 2 ** 30, 1)
        info["SMs"] = props.multi_processor_count
        for key, fn in (("NCCL", lambda: ".".join(map(str, torch.cuda.nccl.version()))),
                        ("cuDNN", lambda: str(torch.backends.cudnn.version()))):
            try:
                info[key] = fn()
            except Exception as error:  # noqa: BLE001
                info[key] = f"unknown ({type(error).__name__})"
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            info["driver"] = smi.stdout.strip().splitlines()[0] if smi.stdout.strip() else "unknown"
        except (OSError, subprocess.SubprocessError):
            info["driver"] = "unknown (no nvidia-smi)"
    write_atomically(args.json, json.dumps(info) + "\n")
    return 0


# -- multi-GPU: torchrun layouts against one GPU ---------------------------------------------------------------
MULTI_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
               "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "10", "--lr", "1e-3",
               "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data", "--vocab-size", "1000",
               "--log-interval", "5", "--eval-iters", "1", "--eval-interval", "1000",
               "--distributed-timeout-minutes", "2"]
MULTI_RTOL = 1e-4  # fp32: TP splits the matmuls' sums and DP the batch's, so sums run in another order


def multi_gpu_layouts(gpus: int) -> list[tuple[int, int, int]]:
    """(processes, TP, ZeRO stage) to launch: TP 2 x DP 2 at stages 1-3 with 4+ GPUs, else TP 2 alone and
    DP 2 alone (stages 1-3) on 2-3 GPUs."""
    if gpus >= 4:
        return [(4, 2, stage) for stage in (1, 2, 3)]
    if gpus >= 2:
        return [(2, 2, 1)] + [(2, 1, stage) for stage in (1, 2, 3)]
    return []


def multi_gpu(args, result: Result) -> str:
    import torch
    gpus = torch.cuda.device_count()
    layouts = multi_gpu_layouts(gpus)
    if not layouts:
        return f"skipped: {gpus} GPU (needs 2 or more)"
    work = tempfile.mkdtemp(prefix="mpzero-gpu-check-")
    env = dict(os.environ)
    result.note(f"{gpus} GPUs; fp32, dropout 0, mock data, 10 iterations; losses compared to the single-GPU run "
                f"within {MULTI_RTOL:g} relative (sums in another order)")

    def launch(name: str, processes: int, flags: list[str], limit: float):
        path = os.path.join(work, f"{name}.json")
        module = ["-m", "tests.gpu.check.train_run", "--json", path, "--"] + MULTI_FLAGS + flags
        cmd = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
                                  if processes > 1 else []) + module
        print("$ " + " ".join(cmd), flush=True)
        start = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, stdout=sys.stdout, stderr=sys.stderr, stdin=subprocess.DEVNULL)
        try:
            proc.wait(timeout=max(limit, 1))
        except subprocess.TimeoutExpired:
            proc.terminate()  # torchrun passes SIGTERM on to its workers
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise RuntimeError(f"killed after {limit:.0f} s") from None
        seconds = time.monotonic() - start
        if proc.returncode != 0:
            raise RuntimeError(f"exit code {proc.returncode}")
        with open(path, encoding="utf-8") as f:
            return json.load(f)["losses"], seconds

    def remaining() -> float:
        return args.limit - result.elapsed() - 5

    try:
        return _multi_gpu_layouts(layouts, launch, remaining, result)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _multi_gpu_layouts(layouts, launch, remaining, result: Result) -> str:
    """The reference run on one GPU, then each layout against it (a row each)."""
    try:
        reference, _ = launch("reference", 1, ["--zero-stage", "1"], min(90, remaining()))
    except Exception as error:  # noqa: BLE001
        result.row(layout="1 GPU (reference)", ok=False, note=error_text(error))
        return "fail"
    result.row(layout="1 GPU (reference)", processes=1, tp=1, dp=1, stage=1, **{"first loss": reference[0],
               "last loss": reference[-1]}, ok=True)
    ok = True
    for processes, tp, stage in layouts:
        layout = f"TP {tp} x DP {processes // tp}, ZeRO-{stage}"
        if remaining() < 20:
            result.row(layout=layout, ok=False, note="not run: out of time")
            ok = False
            continue
        try:
            losses, seconds = launch(f"tp{tp}_dp{processes // tp}_s{stage}", processes,
                                     ["--tensor-model-parallel-size", str(tp), "--zero-stage", str(stage)],
                                     min(120, remaining()))
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference)) if len(losses) == len(
                reference) else math.inf
            good = worst <= MULTI_RTOL
            result.row(layout=layout, processes=processes, tp=tp, dp=processes // tp, stage=stage,
                       **{"first loss": losses[0], "last loss": losses[-1], "max rel diff": worst,
                          "seconds": round(seconds, 1)}, ok=good)
        except Exception as error:  # noqa: BLE001
            result.row(layout=layout, processes=processes, tp=tp, dp=processes // tp, stage=stage, ok=False,
                       note=error_text(error))
            good = False
        ok = ok and good
    return "pass" if ok else "fail"



COLUMNS = {
    "multi_gpu": ["layout", "processes", "tp", "dp", "stage", "first loss", "last loss", "max rel diff", "seconds",
                  "ok", "note"],
    "bench_gpt2": ["model", "tokens/s", "ms/step", "first step s", "peak GiB", "TFLOP/s", "MFU", "MFU (datasheet)",
                   "vs eager", "kernels/step", "host launches/step", "CUDA graph launches/step", "kernel ms/step",
                   "GPU busy", "host syncs/step", "last loss", "ok", "note"],
    "zero_memory": ["stage", "params", "formula", "formula MiB", "counted MiB", "allocated MiB",
                    "allocated / formula", "construction formula MiB", "peak build MiB",
                    "peak build / construction formula", "peak step MiB", "ok", "note"],
    "bench_fp8": ["recipe", "tokens/s", "vs bf16", "ms/step", "first step s", "MFU", "peak GiB", "host syncs/step",
                  "loss", "loss vs bf16", "ok", "note"],
}
PARTS = {"multi_gpu": multi_gpu, "bench_gpt2": bench_gpt2, "zero_memory": zero_memory, "bench_fp8": bench_fp8}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tests.gpu.check.workers")
    p.add_argument("part", choices=["environment", *PARTS])
    p.add_argument("--json", required=True)
    p.add_argument("--limit", type=float, default=300.0, help="seconds this part may take")
    p.add_argument("--micro-batch-size", type=int, default=8, help="bench_gpt2's micro-batch")
    args = p.parse_args(argv)
    if args.part == "environment":
        return environment(args)
    result = Result(args.json, COLUMNS[args.part])
    try:
        import torch
        if not torch.cuda.is_available():
            result.finish("skipped: no CUDA")
            return 0
        status = PARTS[args.part](args, result)
    except Exception as error:  # noqa: BLE001
        result.note("error: " + error_text(error))
        status = "fail"
    result.finish(status)
    return 0


if __name__ == "__main__":
    sys.exit(main())
