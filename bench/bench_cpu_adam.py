"""CPU AdamW over one rank's flat fp32 partition (ZeRO-Offload's optimizer step) against the memory bound.

Run: `PYTHONPATH=. python bench/bench_cpu_adam.py [--numel 33554432] [--threads 1 2] [--repeats 9]`

Times `mpzero.fused.adamw_step` on CPU with each implementation ("torch_fused": torch's fused AdamW, the CPU
default; "torch": the op-by-op reference; "compile": torch.compile of it), without and with the bf16 model
copy, and DeepSpeed's `DeepSpeedCPUAdam` when it imports and builds (optional; `DS_ACCELERATOR=cpu`). Its
step has no bf16 output, so "+ bf16 copy" adds the `copy_` ZeRO-Offload makes after it. AdamW must move 28 B
per parameter (read p, g, m, v; write p, m, v; fp32) plus 2 B for the bf16 copy; the bound is a bandwidth
measured in the same interleaved rounds over tensors of the same size divided by those bytes: a
`dst.copy_(src)` (8 B/element read + written) and an in-place `a += s * b` (12 B/element). The copy's
destination is not read, yet the CPU reads it into cache before writing (write-allocate), so the copy counts
only 2/3 of its traffic; AdamW writes only what it has read, like the in-place add, the tighter bound.
Each implementation is also checked against "torch" on the same inputs (one step from the same state).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from mpzero.fused import adamw_step

HP = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
BYTES_PER_PARAM = {False: 28, True: 30}  # fp32 p, g, m, v read + p, m, v written (+ bf16 copy written)


def deepspeed_adam():
    """(factory of a DeepSpeed step on given tensors or None, its version or why it is not available)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(8))])  # JIT-builds the C++ op on first use
    except Exception as e:  # noqa: BLE001 - any failure means "not available", said in one line
        return None, f"not available: {type(e).__name__}: {e}".splitlines()[0]

    def make(p, g, m, v):
        param = torch.nn.Parameter(p)  # shares p's storage
        param.grad = g
        opt = DeepSpeedCPUAdam([param], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                               weight_decay=HP["weight_decay"], adamw_mode=True)
        opt.state[param] = {"step": 0, "exp_avg": m, "exp_avg_sq": v}

        def step(model_copy, t):
            opt.state[param]["step"] = t - 1  # DeepSpeed increments it before the update
            opt.step()
            if model_copy is not None:
                model_copy.copy_(p)
        return step
    return make, f"{deepspeed.__version__}, cpu_adam op built"


def mpzero_adam(impl):
    def make(p, g, m, v):
        return lambda model_copy, t: adamw_step(p, g, m, v, **HP, step=t, model_copy=model_copy, impl=impl)
    return make


def one_step(make, init):
    """(p, m, v, bf16 copy) after step 10 from copies of `init` (p, g, m, v)."""
    p, g, m, v = (t.clone() for t in init)
    model_copy = torch.empty_like(p, dtype=torch.bfloat16)
    make(p, g, m, v)(model_copy, 10)
    return p, m, v, model_copy


def check(make, init, ref):
    """Max |a - b| and max |a - b| / max |b| over p, m and v against the reference; whether copy == bf16(p).

    (Relative to each tensor's largest magnitude: element by element, values near 0 - m where g ~ m, after the
    lerp's cancellation - turn one rounding difference into any relative size.)"""
    p, m, v, model_copy = one_step(make, init)
    abs_diff = rel_diff = 0.0
    for a, b in zip((p, m, v), ref):
        d = (a - b).abs()
        abs_diff = max(abs_diff, d.max().item())
        rel_diff = max(rel_diff, d.max().item() / b.abs().max().item())
    return abs_diff, rel_diff, torch.equal(model_copy, p.bfloat16())


def interleaved_medians_ms(runs: dict, repeats: int) -> dict:
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():  # round-robin: a shared machine's load hits every variant alike
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 25)
    parser.add_argument("--threads", type=int, nargs="+", default=[os.cpu_count()])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    n = args.numel
    impls = {f"mpzero {i}": mpzero_adam(i) for i in ("torch_fused", "torch", "compile")}
    ds_make, ds_what = deepspeed_adam()
    if ds_make:
        impls["DeepSpeedCPUAdam"] = ds_make
    print(f"torch {torch.__version__}, {n / 1e6:.1f}M fp32 parameters ({n * 4 / 2**20:.0f} MiB per tensor), "
          f"median of {args.repeats} interleaved rounds; DeepSpeed {ds_what}")

    torch.manual_seed(0)
    init = (torch.randn(n), torch.randn(n) * 1e-2, torch.randn(n) * 1e-3, torch.rand(n) * 1e-4)  # p, g, m, v
    ref = one_step(mpzero_adam("torch"), init)[:3]

    state = [t.clone() for t in init]  # all timed steps run on one shared state
    copy_bf16 = torch.empty(n, dtype=torch.bfloat16)
    src, dst = torch.randn(n), torch.empty(n)
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        torch._dynamo.reset()  # inductor bakes the thread count into its kernels: recompile per setting, and
        torch._inductor.config.fx_graph_cache = False  # not from its cache (torch < 2.13 reuses other counts')
        steps, runs, diffs = iter(range(11, 10**9)), {}, {}
        for name, make in impls.items():
            diffs[name] = check(make, init, ref)  # also the first warm-up (compilation for "compile")
            fn = make(*state)
            for with_copy in (False, True):
                mc = copy_bf16 if with_copy else None
                runs[name, with_copy] = lambda fn=fn, mc=mc: fn(mc, next(steps))
                for _ in range(2):  # compiled AdamW recompiles once when `step` first changes
                    runs[name, with_copy]()
        runs["copy"] = lambda: dst.copy_(src)
        runs["in-place"] = lambda: dst.add_(src, alpha=3.0)
        load = os.getloadavg()
        ms = interleaved_medians_ms(runs, args.repeats)
        load = tuple(max(a, b) for a, b in zip(load, os.getloadavg()))
        bws = {"copy": 8 * n / ms["copy"] / 1e6, "in-place": 12 * n / ms["in-place"] / 1e6}  # GB/s
        print(f"\n{threads} thread(s), load average (1/5/15 min, max of start and end; this run's threads "
              f"included) "
              f"{load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}: " + "; ".join(
                  f"{k} {bw:.1f} GB/s -> bound {bw * 1e3 / 28:.0f} Mparams/s (+ bf16 copy {bw * 1e3 / 30:.0f})"
                  for k, bw in bws.items()))
        for (name, with_copy), t in ((k, v) for k, v in ms.items() if isinstance(k, tuple)):
            mps = n / t / 1e3
            ds = ms.get(("DeepSpeedCPUAdam", with_copy))
            rows.append((name + (" + bf16 copy" if with_copy else ""), threads, t, mps,
                         [mps / (bw * 1e3 / BYTES_PER_PARAM[with_copy]) for bw in bws.values()],
                         f"{ds / t:.2f}" if ds else "n/a", diffs[name]))

    print("\n| impl | threads | ms/step | Mparams/s | of copy bound | of in-place bound | vs DeepSpeed | "
          "max abs / rel diff vs torch |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, threads, t, mps, frac, vs_ds, (abs_d, rel_d, copy_ok) in rows:
        print(f"| {name} | {threads} | {t:.1f} | {mps:.0f} | {frac[0]:.0%} | {frac[1]:.0%} | {vs_ds} | "
              f"{abs_d:.1e} / {rel_d:.1e}{'' if copy_ok else ', copy != bf16(p)!'} |")
    print("\nvs DeepSpeed = DeepSpeed's ms / this row's ms, same threads and copy (above 1: faster). Diff over p, m, v "
          "after one step from the same state: abs = max |x - x_torch|, rel = abs / max |x_torch|.")


if __name__ == "__main__":
    main()
