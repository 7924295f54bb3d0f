"""The parts of `make gpu-check` that are not pytest files, one per process:

    python3 -m tests.gpu.check.workers {environment,multi_gpu,bench_gpt2,zero_memory} --json PATH [--limit S]

Each writes its JSON result ({"status", "columns", "rows", "notes"}) after every row, atomically, so a part
killed at its time limit still leaves the rows it finished. Every row is tried on its own: an exception is
that row's error, and the remaining rows still run.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

from mpzero.files import write_atomically

GPT2 = {"num_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "seq_length": 1024, "vocab_size": 50257}
# GPT-2 124M's vocabulary padded to a multiple of 128, as mpzero pads it (and nanoGPT does)
GPT2_PADDED_VOCAB = 50304


class Result:
    def __init__(self, path: str, columns: list[str]):
        self.path, self.data, self.start = path, {"status": "incomplete", "columns": columns, "rows": [],
                                                  "notes": []}, time.monotonic()

    def row(self, **row) -> None:
        self.data["rows"].append(row)
        self.flush()

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self.flush()

    def finish(self, status: str) -> None:
        self.data["status"] = status
        self.flush()

    def flush(self) -> None:
        write_atomically(self.path, json.dumps(self.data, indent=1, default=str) + "\n")

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def _error_text(error: BaseException) -> str:
    traceback.print_exc()  # the full traceback goes to the part's log
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200] if str(error).strip() else ''}"


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
        reference, _ = launch("reference", 1, ["--zero-stage", "1"], min(90, remaining()))
    except Exception as error:  # noqa: BLE001
        result.row(layout="1 GPU (reference)", ok=False, note=_error_text(error))
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
                       note=_error_text(error))
            good = False
        ok = ok and good
    return "pass" if ok else "fail"


# -- GPT-2 124M step benchmark ------------------------------------------------------------------------------
def _sync_time(fn, steps: int) -> float:
    import torch
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def matmul_peak_tflops(n: int = 8192, repeats: int = 20) -> float:
    """bf16 dense matmul throughput of this GPU, measured: the median of `repeats` [n, n] x [n, n] products."""
    import torch
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del a, b
    return 2 * n ** 3 / statistics.median(times) / 1e12


def _free_cuda() -> None:
    import torch
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _eager_step(inputs, labels, compile_: bool):
    """nanoGPT's step: autocast bf16, fused AdamW, clip 1.0; (step, its losses)."""
    import torch
    from bench.baselines import eager_gpt2
    model = eager_gpt2(GPT2_PADDED_VOCAB, 768, 12, 12, GPT2["seq_length"]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    run = torch.compile(model) if compile_ else model
    losses = []

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(inputs, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return step, losses


def _mpzero_step(groups, inputs, labels, backend: str, compiled: bool = False):
    """mpzero's step through its ZeRO-1 optimizer in bf16 (a world of one); (step, its losses)."""
    from mpzero.models import GPTConfig, GPTModel
    from mpzero.tensor_parallel import seed_everything
    from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer

    seq = GPT2["seq_length"]
    config = GPTConfig(num_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=GPT2["vocab_size"],
                       max_position_embeddings=seq, hidden_dropout=0.0, attention_dropout=0.0,
                       attention_backend=backend, torch_compile=compiled, seq_length=seq)
    model = GPTModel(config, groups.tp, seed_everything(1234, 0, groups.device), device=groups.device)
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=1), AdamConfig(lr=6e-4, beta2=0.95, weight_decay=0.1,
                                                                      clip_grad=1.0), PrecisionConfig("bf16"))
    losses = []

    def step():
        opt.zero_grad()
        loss = model(inputs, labels).mean()
        opt.backward(loss, last_micro_batch=True)
        opt.step(6e-4)
        losses.append(loss.detach())
    return step, losses


def _measure_step(name: str, build, tokens_per_step: int, warmup: int, timed: int) -> dict:
    """One variant's figures: tokens/s, ms/step, first step, peak memory, kernels per step (its per-op table goes to
    this part's log, logs/bench_gpt2.log) and the last loss."""
    import torch
    from bench.baselines import step_profile

    step = losses = None
    try:
        _free_cuda()
        base = torch.cuda.memory_allocated()
        step, losses = build()
        first = _sync_time(step, 1)  # compilation, Triton autotuning and allocator warm-up happen here
        _sync_time(step, warmup - 1)
        seconds = _sync_time(step, timed)
        peak_bytes = torch.cuda.max_memory_allocated() - base
        kernels, table = step_profile(step, cuda=True)
        print(f"== {name}: one step by self CUDA time ({kernels} kernels) ==\n{table}", flush=True)
        return {"tps": tokens_per_step * timed / seconds, "ms/step": round(seconds / timed * 1000, 2),
                "first step s": round(first, 1), "peak GiB": round(peak_bytes / 2 ** 30, 2),
                "kernels/step": kernels, "losses": [float(x) for x in losses[-timed:]]}
    finally:
        del step, losses
        _free_cuda()


def bench_gpt2(args, result: Result) -> str:
    import torch
    from mpzero.models import GPTConfig
    from mpzero.parallel import init_parallel

    batch, warmup, timed = args.micro_batch_size, 3, 10
    seq, tokens_per_step = GPT2["seq_length"], args.micro_batch_size * GPT2["seq_length"]
    torch.cuda.set_device(0)
    peak = matmul_peak_tflops()
    flops_per_token = GPTConfig(num_layers=12, hidden_size=768, num_attention_heads=12,  # model FLOPs: no recompute
                                vocab_size=GPT2_PADDED_VOCAB, max_position_embeddings=seq, seq_length=seq,
                                cross_entropy_chunk_size=0).flops_per_token()
    result.note(f"bf16 matmul peak measured in this run: {peak:.0f} TFLOP/s ([8192, 8192] x [8192, 8192] "
                f"torch.matmul, median of 20); MFU = {flops_per_token / 1e6:.0f} MFLOP/token (Megatron's "
                f"72 l h^2 (1 + s/6h + V/16lh), vocab {GPT2_PADDED_VOCAB}) x tokens/s / that peak")
    result.note("kernels/step: CUDA kernels launched in one step (torch.profiler); each variant's per-op breakdown "
                "of that step is in this part's log")
    result.note(f"GPT-2 124M: 12 layers, hidden 768, 12 heads, seq {seq}, micro-batch {batch} ({tokens_per_step} "
                f"tokens/step), dropout 0, AdamW (lr 6e-4, betas 0.9/0.95, wd 0.1), clip 1.0; {warmup} warm-up "
                f"+ {timed} timed steps; peak memory = torch.cuda.max_memory_allocated from model build to the "
                f"last step")
    tokens = torch.randint(0, GPT2["vocab_size"], (batch, seq + 1), device="cuda")
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    groups = init_parallel(1)  # NCCL, a world of one
    variants = [("eager PyTorch (SDPA, autocast bf16, fused AdamW)", lambda: _eager_step(inputs, labels, False)),
                ("mpzero defaults (auto: flash attention, torch LayerNorm), ZeRO-1 bf16",
                 lambda: _mpzero_step(groups, inputs, labels, "auto")),
                ("mpzero --attention-backend local (core attention, Triton softmax)",
                 lambda: _mpzero_step(groups, inputs, labels, "local")),
                ("mpzero --torch-compile, ZeRO-1 bf16", lambda: _mpzero_step(groups, inputs, labels, "auto", True)),
                ("eager PyTorch + torch.compile", lambda: _eager_step(inputs, labels, True))]
    eager_tps, ok = None, True
    for name, build in variants:
        if args.limit - result.elapsed() < 45:
            result.row(model=name, ok=False, note="not run: out of time")
            ok = False
            continue
        try:
            figures = _measure_step(name, build, tokens_per_step, warmup, timed)
        except Exception as error:  # noqa: BLE001
            result.row(model=name, ok=False, note=_error_text(error))
            ok = False
            continue
        tps, final = figures.pop("tps"), figures.pop("losses")
        finite = all(math.isfinite(x) for x in final)
        eager_tps = tps if eager_tps is None else eager_tps
        result.row(model=name, **{"tokens/s": round(tps), **figures, "TFLOP/s": round(flops_per_token * tps / 1e12, 1),
                                  "MFU": round(flops_per_token * tps / (peak * 1e12), 3),
                                  "vs eager": round(tps / eager_tps, 3), "last loss": round(final[-1], 4)},
                   ok=finite)
        ok = ok and finite
    return "pass" if ok else "fail"


# -- ZeRO memory line against the allocator ----------------------------------------------------------------
def zero_memory(args, result: Result) -> str:
    import torch
    from mpzero.models import GPTConfig, GPTModel
    from mpzero.parallel import init_parallel
    from mpzero.tensor_parallel import seed_everything
    from mpzero.zero import ZeroOptimizer
    from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig

    groups = init_parallel(1)
    seq, batch = GPT2["seq_length"], 4
    config = GPTConfig(num_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=GPT2["vocab_size"],
                       max_position_embeddings=seq, hidden_dropout=0.0, attention_dropout=0.0, seq_length=seq,
                       use_flash_attn=True)
    tokens = torch.randint(0, GPT2["vocab_size"], (batch, seq + 1), device=groups.device)
    result.note("GPT-2 124M, bf16 (fp32 masters and gradients), world of one (N = 1), flash attention. "
                "'counted' = the zero memory line's measured bytes (unique storages held by the stage and the "
                "master store); 'allocated' = torch.cuda.memory_allocated after the optimizer is built (model "
                "built on the GPU and cast by the optimizer); 'peak build' = max_memory_allocated while building; "
                f"'peak step' = max_memory_allocated through one training step at micro-batch {batch} x {seq}. "
                "ok: counted within 1% of the formula, and allocated within 2% + 32 MiB of counted")
    ok = True
    for stage in (0, 1, 2, 3):
        model = opt = None
        try:
            _free_cuda()
            base = torch.cuda.memory_allocated()
            model = GPTModel(config, groups.tp, seed_everything(1234, 0, groups.device), device=groups.device)
            opt = ZeroOptimizer(model, groups, ZeroConfig(stage=stage), AdamConfig(lr=1e-4),
                                PrecisionConfig("bf16"))
            torch.cuda.synchronize()
            allocated = torch.cuda.memory_allocated() - base
            peak_build = torch.cuda.max_memory_allocated() - base
            line = opt.memory_report()
            print(line.line(), flush=True)
            opt.zero_grad()
            loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
            opt.backward(loss, last_micro_batch=True)
            opt.step(1e-4)
            torch.cuda.synchronize()
            peak_step = torch.cuda.max_memory_allocated() - base
            good = (abs(line.measured / line.formula - 1) <= 0.01
                    and abs(allocated - line.measured) <= 0.02 * line.measured + 32 * 2 ** 20)
            mib = 2 ** 20
            result.row(stage=stage, params=line.numel, formula=line.formula_text,
                       **{"formula MiB": round(line.formula / mib, 1), "counted MiB": round(line.measured / mib, 1),
                          "allocated MiB": round(allocated / mib, 1),
                          "allocated / formula": round(allocated / line.formula, 4),
                          "peak build MiB": round(peak_build / mib, 1), "peak step MiB": round(peak_step / mib, 1)},
                       ok=good)
            ok = ok and good
        except Exception as error:  # noqa: BLE001
            result.row(stage=stage, ok=False, note=_error_text(error))
            ok = False
        finally:
            del model, opt
            _free_cuda()
    return "pass" if ok else "fail"


COLUMNS = {
    "multi_gpu": ["layout", "processes", "tp", "dp", "stage", "first loss", "last loss", "max rel diff", "seconds",
                  "ok", "note"],
    "bench_gpt2": ["model", "tokens/s", "ms/step", "first step s", "peak GiB", "TFLOP/s", "MFU", "vs eager",
                   "kernels/step", "last loss", "ok", "note"],
    "zero_memory": ["stage", "params", "formula", "formula MiB", "counted MiB", "allocated MiB",
                    "allocated / formula", "peak build MiB", "peak step MiB", "ok", "note"],
}
PARTS = {"multi_gpu": multi_gpu, "bench_gpt2": bench_gpt2, "zero_memory": zero_memory}


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
        result.note("error: " + _error_text(error))
        status = "fail"
    result.finish(status)
    return 0


if __name__ == "__main__":
    sys.exit(main())
