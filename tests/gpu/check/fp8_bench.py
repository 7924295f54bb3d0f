"""bench_fp8, the FP8 part of `make gpu-check` (issue 46): a LLaMA-shaped ~1B model trained by mpzero's ZeRO-1 step
(--torch-compile, the step launched with no host synchronisation) in bf16 and in each torchao FP8 recipe
(mpzero/tensor_parallel/fp8.py): tokens/s and its ratio to bf16 (the goal: >= 1.2x), MFU against the bf16 matmul
peak measured in the same run (model FLOPs, whatever precision runs them), peak memory, host synchronisations per
step, and the loss after `STEPS` steps against bf16's (within 3%). Every variant trains on the same few batches,
cycled, so the losses fall and compare.

The variants are built from a `LlamaShape` on whatever device the batches are on, so tests/test_gpu_check_steps.py
trains them at a tiny shape on the CPU first.
"""

from __future__ import annotations

import importlib.metadata
import math
from dataclasses import dataclass

from tests.gpu.check import gpt2_step
from tests.gpu.check.gpt2_step import Step
from tests.gpu.check.result import Result, error_text


@dataclass(frozen=True)
class LlamaShape:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    seq_length: int
    vocab_size: int


LLAMA_1B = LlamaShape(num_layers=18, hidden_size=2048, num_attention_heads=16, num_query_groups=4, seq_length=2048,
                      vocab_size=32000)  # 0.93B parameters: SwiGLU width 5440, untied output layer
RECIPES = {"bf16": None, "tensorwise": ("hybrid", "tensorwise"), "rowwise": ("e4m3", "rowwise"),
           "rowwise_with_gw_hp": ("e4m3", "rowwise_with_gw_hp")}
STEPS, TIMED, BATCHES, MICRO_BATCH = 100, 20, 4, 4  # steps per variant (the last TIMED timed), batches cycled
LOSS_RTOL, GOAL = 0.03, 1.2
COMPILED = True  # --torch-compile (torchao's speed needs its casts fused); the CPU test runs the part eagerly


def llama_config(shape: LlamaShape, recipe: str, compiled: bool):
    """mpzero's GPTConfig of the LLaMA family at `shape`, dropout 0, in the recipe's FP8 (None: bf16)."""
    from mpzero.models import GPTConfig
    fp8 = RECIPES[recipe]
    return GPTConfig(num_layers=shape.num_layers, hidden_size=shape.hidden_size,
                     num_attention_heads=shape.num_attention_heads, vocab_size=shape.vocab_size,
                     max_position_embeddings=shape.seq_length, seq_length=shape.seq_length, hidden_dropout=0.0,
                     attention_dropout=0.0, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                     add_bias_linear=False, untie_embeddings_and_output_weights=True, group_query_attention=True,
                     num_query_groups=shape.num_query_groups, torch_compile=compiled,
                     fp8_format=fp8[0] if fp8 else None, fp8_recipe=fp8[1] if fp8 else "tensorwise")


def llama_step(shape: LlamaShape, groups, batches: list, recipe: str, compiled: bool = True) -> Step:
    """One ZeRO-1 bf16 step of the model (AdamW, clip 1.0) on the next of `batches` ([b, s + 1] token tensors),
    launched with no host synchronisation."""
    from mpzero.models import GPTModel
    from mpzero.tensor_parallel import seed_everything
    from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer
    model = GPTModel(llama_config(shape, recipe, compiled), groups.tp, seed_everything(1234, 0, groups.device),
                     device="meta")
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=1), AdamConfig(lr=3e-4, beta2=0.95, weight_decay=0.1,
                                                                      clip_grad=1.0), PrecisionConfig("bf16"))
    taken = []

    def forward():
        opt.zero_grad()
        tokens = batches[len(taken) % len(batches)]
        taken.append(1)
        return model(tokens[:, :-1], tokens[:, 1:]).mean()
    return Step(forward, lambda loss: opt.backward(loss, last_micro_batch=True), lambda: opt.launch_step(3e-4), [])


def _variant(shape, groups, batches, recipe, tokens_per_step, peak, flops_per_token) -> dict:
    import torch
    step = None
    try:
        gpt2_step.free_cuda()
        base = torch.cuda.memory_allocated()
        step = llama_step(shape, groups, batches, recipe, COMPILED)
        first = gpt2_step.timed_steps(step, 1)  # compilation happens here
        gpt2_step.timed_steps(step, STEPS - TIMED - 2)
        syncs = gpt2_step.host_syncs_per_step(step)
        seconds = gpt2_step.timed_steps(step, TIMED)
        tps = tokens_per_step * TIMED / seconds
        return {"tokens/s": round(tps), "ms/step": round(seconds / TIMED * 1000, 1), "first step s": round(first, 1),
                "MFU": round(flops_per_token * tps / (peak * 1e12), 3),
                "peak GiB": round((torch.cuda.max_memory_allocated() - base) / 2 ** 30, 2),
                "host syncs/step": syncs, "loss": float(step.losses[-1])}
    finally:
        del step
        gpt2_step.free_cuda()


def torchao_version() -> str | None:
    """torchao's installed version, or None where this python has none (a GPU machine's own image may lack it)."""
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return None


def bench_fp8(args, result: Result) -> str:
    if torchao_version() is None:  # every FP8 row would fail: skip before the bf16 row spends device time
        return ("skipped: torchao is not installed for this python; where there is no network, carry its wheel: "
                "`make gpu-wheels` where pip reaches an index, then `make gpu-check` (docs/gpu.md)")
    import torch
    from mpzero.parallel import init_parallel
    shape = LLAMA_1B
    torch.cuda.set_device(0)
    groups = init_parallel(1)
    peak = gpt2_step.matmul_peak_tflops()
    flops_per_token = llama_config(shape, "bf16", COMPILED).flops_per_token()
    tokens_per_step = MICRO_BATCH * shape.seq_length
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, shape.vocab_size, (MICRO_BATCH, shape.seq_length + 1), generator=gen).to(groups.device)
               for _ in range(BATCHES)]
    result.note(f"LLaMA ~1B: {shape}, SwiGLU, RoPE, GQA, untied output; ZeRO-1 bf16 AdamW, --torch-compile, the step "
                f"launched with no host synchronisation; {tokens_per_step} tokens/step, {BATCHES} batches cycled, "
                f"{STEPS} steps per variant (the last {TIMED} timed); MFU: {flops_per_token / 1e9:.2f} GFLOP/token "
                f"x tokens/s over the bf16 matmul peak measured here, {peak:.0f} TFLOP/s; goal: FP8 >= {GOAL}x bf16 "
                f"tokens/s with the loss within {LOSS_RTOL:.0%}")
    ok, bf16 = True, None
    for recipe in RECIPES:
        if args.limit - result.elapsed() < 60:
            result.row(recipe=recipe, ok=False, note="not run: out of time")
            ok = False
            continue
        try:
            figures = _variant(shape, groups, batches, recipe, tokens_per_step, peak, flops_per_token)
        except Exception as error:  # noqa: BLE001
            result.row(recipe=recipe, ok=False, note=error_text(error))
            ok = False
            continue
        bf16 = figures if recipe == "bf16" else bf16
        good, notes = math.isfinite(figures["loss"]) and not figures["host syncs/step"], []
        if bf16 is not None and recipe != "bf16":
            ratio, off = figures["tokens/s"] / bf16["tokens/s"], (figures["loss"] - bf16["loss"]) / bf16["loss"]
            figures.update({"vs bf16": round(ratio, 3), "loss vs bf16": f"{off:+.2%}"})
            good = good and abs(off) <= LOSS_RTOL
            notes.append(f"goal {'met' if ratio >= GOAL else 'not met'}: x{ratio:.3f} of bf16's tokens/s")
        result.row(recipe=recipe, **figures, ok=good, **({"note": "; ".join(notes)} if notes else {}))
        ok = ok and good
    return "pass" if ok else "fail"
