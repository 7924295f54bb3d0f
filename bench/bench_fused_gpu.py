"""Time the Triton kernels against eager PyTorch, torch.compile (and NVIDIA apex where installed) on one CUDA GPU,
the chunked cross entropy's arithmetic by its reference and torch.compile'd, and the gradient norm's sum of squares
by its reference and kernel.

Run: `PYTHONPATH=. python bench/bench_fused_gpu.py [--dtype bf16] [--small | --gpt2] [--json out.json]`
(needs CUDA and `mpzero[triton]`; `make gpu-check` runs it with `--gpt2 --json`)

Eager = each op's PyTorch reference in mpzero.fused; "compile" = that reference under torch.compile (its
compilation is excluded: do_bench warms up first); AdamW also runs torch's fused AdamW ("torch_fused").
`--gpt2` times GPT-2 124M's shapes (8 x 1024 tokens, hidden 768, 12 heads, 124M parameters).
apex rows use apex's mixed-dtype FusedLayerNorm, Megatron's upper-triangular softmax kernel and FusedAdam
(adam_w_mode) and are skipped with a note when apex is not importable. Times are triton.testing.do_bench
medians (ms); ratio = eager / implementation, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

import torch

from mpzero.fused import adamw_step, layer_norm, rms_norm, scaled_masked_softmax, sum_of_squares

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _layer_norm_cases(tokens: int, hidden: int, dtype: torch.dtype) -> dict:
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.ones(hidden, device="cuda", requires_grad=True)
    b = torch.zeros(hidden, device="cuda", requires_grad=True)
    dy = torch.randn_like(x)
    cases = {impl: (lambda impl=impl: layer_norm(x, w, b, impl=impl).backward(dy))
             for impl in ("torch", "compile", "triton")}
    try:
        from apex.normalization.fused_layer_norm import mixed_dtype_fused_layer_norm_affine
        cases["apex"] = lambda: mixed_dtype_fused_layer_norm_affine(x, w, b, (hidden,), 1e-5).backward(dy)
    except ImportError:
        pass
    return cases


def _rms_norm_cases(tokens: int, hidden: int, dtype: torch.dtype) -> dict:
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.ones(hidden, device="cuda", requires_grad=True)
    dy = torch.randn_like(x)
    return {impl: (lambda impl=impl: rms_norm(x, w, impl=impl).backward(dy)) for impl in ("torch", "compile", "triton")}


def _softmax_cases(batch_heads: int, seq: int, dtype: torch.dtype) -> dict:
    scores = torch.randn(1, batch_heads, seq, seq, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn_like(scores)
    cases = {impl: (lambda impl=impl: scaled_masked_softmax(scores, 0.125, True, None, impl=impl).backward(dy))
             for impl in ("torch", "compile", "triton")}
    try:
        from apex.transformer.functional.fused_softmax import ScaledUpperTriangMaskedSoftmax
        scores3d = scores.detach().view(batch_heads, seq, seq).requires_grad_()
        dy3d = dy.view(batch_heads, seq, seq)
        cases["apex"] = lambda: ScaledUpperTriangMaskedSoftmax.apply(scores3d, 0.125).backward(dy3d)
    except ImportError:
        pass
    return cases


def _adamw_cases(numel: int, dtype: torch.dtype) -> dict:
    params, grads = torch.randn(numel, device="cuda"), torch.randn(numel, device="cuda")
    exp_avg, exp_avg_sq = torch.zeros_like(params), torch.zeros_like(params)
    copy = torch.empty(numel, device="cuda", dtype=dtype) if dtype != torch.float32 else None

    def step(impl):
        adamw_step(params, grads, exp_avg, exp_avg_sq, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8,
                   weight_decay=0.1, step=10, model_copy=copy, impl=impl)
    cases = {impl: (lambda impl=impl: step(impl)) for impl in ("torch", "compile", "torch_fused", "triton")}
    try:
        from apex.optimizers import FusedAdam
        param = torch.nn.Parameter(params.clone())
        param.grad = grads.clone()
        opt = FusedAdam([param], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, adam_w_mode=True)
        cases["apex"] = opt.step  # without the low-precision copy: apex's FusedAdam does not write one
    except ImportError:
        pass
    return cases


def _sum_of_squares_cases(numel: int) -> dict:
    """The global norm's fp64 sum of squares over fp32 gradients (mpzero.zero.norm): reference and kernel."""
    grads = torch.randn(numel, device="cuda")
    return {impl: (lambda impl=impl: sum_of_squares(grads, impl=impl)) for impl in ("torch", "triton")}


def _cross_entropy_cases(tokens: int, hidden: int, vocab: int, chunk: int, dtype: torch.dtype,
                         device: str = "cuda") -> dict:
    """The output projection + loss, forward and backward, chunked (--cross-entropy-chunk-size): the chunk
    arithmetic by its reference ("torch") and fused by torch.compile ("compile", --cross-entropy-loss-fusion)."""
    from mpzero.parallel import init_parallel
    from mpzero.tensor_parallel import vocab_parallel_linear_cross_entropy
    tp = init_parallel(1).tp
    x = (torch.randn(1, tokens, hidden, device=device) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden, device=device) * 0.02).to(dtype).requires_grad_()
    target = torch.randint(0, vocab - 47, (1, tokens), device=device)  # GPT-2's 50257 in 50304 padded rows

    def step(impl):
        vocab_parallel_linear_cross_entropy(x, weight, target, tp, vocab - 47, chunk, impl=impl).mean().backward()
    return {impl: (lambda impl=impl: step(impl)) for impl in ("torch", "compile")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="activations and model copy")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--small", action="store_true", help="small sizes, to check the script runs")
    sizes.add_argument("--gpt2", action="store_true", help="GPT-2 124M's shapes (micro-batch 8, seq 1024)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here (for make gpu-check)")
    args = parser.parse_args()
    rows, notes = [], []

    def write_json(status: str) -> None:
        if args.json:
            from mpzero.files import write_atomically
            columns = ["op", "impl", "ms", "x eager", "note"]
            write_atomically(args.json, json.dumps({"status": status, "columns": columns, "rows": rows,
                                                    "notes": notes}, indent=1) + "\n")

    if not torch.cuda.is_available():
        print("error: bench_fused_gpu.py needs a CUDA GPU; run bench/bench_fused_cpu.py here", file=sys.stderr)
        write_json("skipped: no CUDA")
        return 2
    from triton.testing import do_bench

    dtype, k = DTYPES[args.dtype], 8 if args.small else 1
    if args.gpt2:
        ops = {
            f"layer_norm x [8192, 768] {args.dtype} fwd+bwd": lambda: _layer_norm_cases(8192, 768, dtype),
            f"rms_norm x [8192, 768] {args.dtype} fwd+bwd": lambda: _rms_norm_cases(8192, 768, dtype),
            f"causal softmax [1, 96, 1024, 1024] {args.dtype} fwd+bwd": lambda: _softmax_cases(96, 1024, dtype),
            f"adamw flat 124M fp32 (+ {args.dtype} copy)": lambda: _adamw_cases(124_475_904, dtype),
            "gradient norm: fp64 sum of squares of 124M fp32": lambda: _sum_of_squares_cases(124_475_904),
            f"output projection + loss [8192, 768] x [50304, 768] {args.dtype}, chunks of 2048, fwd+bwd":
                lambda: _cross_entropy_cases(8192, 768, 50304, 2048, dtype),
        }
    else:
        ops = {
            f"layer_norm x [{16384 // k}, 4096] fwd+bwd": lambda: _layer_norm_cases(16384 // k, 4096, dtype),
            f"rms_norm x [{16384 // k}, 4096] fwd+bwd": lambda: _rms_norm_cases(16384 // k, 4096, dtype),
            f"causal softmax [1, {64 // k}, 2048, 2048] fwd+bwd": lambda: _softmax_cases(64 // k, 2048, dtype),
            f"adamw flat {256 // k}M fp32 (+ {args.dtype} copy)": lambda: _adamw_cases((256 << 20) // k, dtype),
            f"gradient norm: fp64 sum of squares of {256 // k}M fp32": lambda: _sum_of_squares_cases((256 << 20) // k),
            f"output projection + loss [{16384 // k}, 4096] x [32000, 4096], chunks of 2048, fwd+bwd":
                lambda: _cross_entropy_cases(16384 // k, 4096, 32000, 2048, dtype),
        }
    notes.append(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms = triton.testing.do_bench "
                 f"median; x eager = eager ms / impl ms (above 1: faster than eager)")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}; ms (median), ratio = eager / impl")
    ok = True
    for name, make_cases in ops.items():
        print(f"\n{name}", flush=True)
        try:
            cases = make_cases()
            eager_ms = do_bench(cases["torch"])
        except Exception as error:  # noqa: BLE001 - one op's failure is its row; the others still run
            traceback.print_exc()
            rows.append({"op": name, "impl": "torch", "note": f"{type(error).__name__}: {str(error)[:200]}"})
            ok = False
            write_json("incomplete")
            continue
        for impl, fn in cases.items():
            try:
                ms = eager_ms if impl == "torch" else do_bench(fn)
            except Exception as error:  # noqa: BLE001
                traceback.print_exc()
                rows.append({"op": name, "impl": impl, "note": f"{type(error).__name__}: {str(error)[:200]}"})
                ok = False
                continue
            print(f"  {impl:12s} {ms:8.3f} ms   x{eager_ms / ms:5.2f}", flush=True)
            rows.append({"op": name, "impl": impl, "ms": round(ms, 4), "x eager": round(eager_ms / ms, 3)})
            write_json("incomplete")
        if "apex" not in cases:
            print("  apex         not installed")
        del cases
        torch.cuda.empty_cache()
    if not any(r.get("impl") == "apex" for r in rows):
        notes.append("apex: not installed")
    write_json("pass" if ok else "fail")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
