"""bench_gpt2, the GPT-2 124M training-step part of `make gpu-check`: mpzero's step (ZeRO-1, bf16, a world of one)
against nanoGPT's eager step with and without torch.compile, in tokens/s, MFU against the bf16 matmul peak measured
in the same run, peak memory and CUDA kernels per step. Each variant is timed in one window after the one before;
then, if the part has time left, the goal's variants again in interleaved rounds (`interleaved_rounds`), which
rank what one window cannot (bench/bench_rounds.py runs the same rounds on its own).

The variants are built from a `Shape` on whatever device the tokens are on, so tests/test_gpu_check.py trains
each of them at a tiny shape on the CPU: what the GPU runs is proven to build and train before a GPU is lent.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

from tests.gpu.check.result import Result, error_text


@dataclass(frozen=True)
class Shape:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int  # the tokenizer's; mpzero pads it (to 50304 for GPT-2, as nanoGPT does)


GPT2_124M = Shape(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024, vocab_size=50257)


def gpt_config(shape: Shape, **overrides):
    """mpzero's GPTConfig of `shape`, dropout 0, with `overrides` (the implementation choices of a variant)."""
    from mpzero.models import GPTConfig
    return GPTConfig(**{"num_layers": shape.num_layers, "hidden_size": shape.hidden_size,
                        "num_attention_heads": shape.num_attention_heads, "vocab_size": shape.vocab_size,
                        "max_position_embeddings": shape.seq_length, "seq_length": shape.seq_length,
                        "hidden_dropout": 0.0, "attention_dropout": 0.0, **overrides})


@dataclass
class Step:
    """One training step in its three phases, which bench/bench_host.py times apart; calling it runs them in order
    and keeps the loss. (The optimizer phase's host time on a CPU includes its arithmetic: a GPU launches it.)"""
    forward: Callable[[], object]  # -> the loss
    backward: Callable[[object], None]
    update: Callable[[], None]  # clipping, the optimizer's step, clearing the gradients
    losses: list

    def __call__(self) -> None:
        loss = self.forward()
        self.backward(loss)
        self.update()
        self.losses.append(loss.detach())


def eager_step(shape: Shape, inputs, labels, compiled: bool, read_norm: bool = False) -> Step:
    """nanoGPT's step: autocast bf16, fused AdamW, clip 1.0. `read_norm`: the gradient norm is read to the host
    before the update, one synchronisation a step as Megatron's step and mpzero's take (nanoGPT takes none): what
    that costs a launch-bound step."""
    import torch
    from bench.baselines import eager_gpt2
    torch.manual_seed(1234)  # the same weights with and without torch.compile
    model = eager_gpt2(gpt_config(shape).padded_vocab_size(1), shape.hidden_size, shape.num_layers,
                       shape.num_attention_heads, shape.seq_length).to(inputs.device)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    run = torch.compile(model) if compiled else model

    def forward():
        with torch.autocast(inputs.device.type, dtype=torch.bfloat16):
            return run(inputs, labels)

    def update():
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if read_norm:
            norm.item()  # the host read is the point: the value is not used
        opt.step()
        opt.zero_grad(set_to_none=True)
    return Step(forward, lambda loss: loss.backward(), update, [])


def mpzero_step(shape: Shape, groups, inputs, labels, backend: str, compiled: bool = False, fused_loss: bool = False,
                one_region: bool = True, loss_chunk: int | None = None, cuda_graphs: bool = False,
                launched: bool = False) -> Step:
    """mpzero's step through its ZeRO-1 optimizer in bf16 (a world of one). `compiled`:
    --torch-compile; `fused_loss`: --cross-entropy-loss-fusion; `one_region` False: the compiled layers one region
    each, as a run that cannot compile its trunk as one (ZeRO-3, TP > 1, recomputation) does; `loss_chunk`:
    --cross-entropy-chunk-size (None: its default; the micro-batch's tokens: one chunk, no logits recomputed in
    backward, all the tokens' fp32 exponentials held); `cuda_graphs`: --cuda-graph-impl local (with `compiled`);
    `launched`: the update launched with no host synchronisation (`ZeroOptimizer.launch_step`, what pretrain_gpt.py
    runs between log lines), else the synchronising `step` (the gradient norm read first)."""
    import mpzero.models.gpt as gpt
    from mpzero.models import GPTModel
    from mpzero.tensor_parallel import seed_everything
    from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer

    config = gpt_config(shape, attention_backend=backend, torch_compile=compiled,
                        cross_entropy_impl="compile" if fused_loss else "auto",
                        cuda_graph_impl="local" if cuda_graphs else "none",
                        **({} if loss_chunk is None else {"cross_entropy_chunk_size": loss_chunk}))
    trunk_compilable = gpt.trunk_compilable
    if not one_region:
        gpt.trunk_compilable = lambda config, tp_size: False
    try:
        model = GPTModel(config, groups.tp, seed_everything(1234, 0, groups.device), device=groups.device)
    finally:
        gpt.trunk_compilable = trunk_compilable
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=1), AdamConfig(lr=6e-4, beta2=0.95, weight_decay=0.1,
                                                                      clip_grad=1.0), PrecisionConfig("bf16"))

    def forward():
        opt.zero_grad()
        return model(inputs, labels).mean()
    update = (lambda: opt.launch_step(6e-4)) if launched else (lambda: opt.step(6e-4))
    return Step(forward, lambda loss: opt.backward(loss, last_micro_batch=True), update, [])


def variants(shape: Shape, groups, inputs, labels) -> list:
    """(name, build) of each step measured, in the report's order (the goal's pair and CUDA graphs first, should
    time run out); build() -> a `Step`."""
    def mpzero(*args, **kwargs):
        return lambda: mpzero_step(shape, groups, inputs, labels, *args, **kwargs)
    one_chunk = inputs.numel()
    return [("eager PyTorch (SDPA, autocast bf16, fused AdamW)", lambda: eager_step(shape, inputs, labels, False)),
            ("mpzero defaults (auto: flash attention, torch LayerNorm), ZeRO-1 bf16", mpzero("auto")),
            ("eager PyTorch + torch.compile", lambda: eager_step(shape, inputs, labels, True)),
            ("mpzero --torch-compile, ZeRO-1 bf16", mpzero("auto", True)),
            ("mpzero --torch-compile --cuda-graph-impl local (the trunk's forward and backward as CUDA graphs)",
             mpzero("auto", True, cuda_graphs=True)),
            ("mpzero --torch-compile --cuda-graph-impl local, the loss in one chunk of the micro-batch",
             mpzero("auto", True, cuda_graphs=True, loss_chunk=one_chunk)),
            ("mpzero --torch-compile --cross-entropy-loss-fusion", mpzero("auto", True, True)),
            ("mpzero --attention-backend local (core attention, Triton softmax)", mpzero("local")),
            ("mpzero --torch-compile, a compiled region per layer (as at ZeRO-3, TP > 1, recomputation)",
             mpzero("auto", True, one_region=False)),
            ("eager PyTorch + torch.compile, the gradient norm read to the host each step (as mpzero's step)",
             lambda: eager_step(shape, inputs, labels, True, read_norm=True)),
            ("mpzero --torch-compile, the loss in one chunk of the micro-batch (no logits recomputed in backward)",
             mpzero("auto", True, loss_chunk=one_chunk)),
            ("mpzero --torch-compile --cuda-graph-impl local, the step launched with no host synchronisation",
             mpzero("auto", True, cuda_graphs=True, launched=True))]


GRAPHED = (4, 5, 11)  # variants replaying CUDA graphs: their profiled step must launch some
# Pairs of variants that must give the same losses: the same kernels, one of them replayed from CUDA graphs
# (bitwise unless inductor's autotuning picked another launch configuration for a reduction when compiling again),
# or the same step launched without reading the norm first (the same arithmetic: zero/device_step.py)
SAME_LOSSES = ((3, 4), (10, 5), (4, 11))
NO_SYNC = (0, 2, 11)  # variants whose step must not synchronise with the host (nanoGPT's; mpzero's launched step)
SAME_LOSSES_RTOL = 2e-3  # bf16 sums in another order (tests/test_gpu_check.py's BF16_RTOL)


def _same_losses_note(index: int, measured: dict, named: list) -> str | None:
    """Whether variant `index` gave the losses of its `SAME_LOSSES` partner, measured before it: a note starting
    "the same losses" if so (None: it has no partner, or that one did not run yet)."""
    partner = next((a if b == index else b for a, b in SAME_LOSSES if index in (a, b)), None)
    if partner not in measured:
        return None
    mine, theirs, name = measured[index], measured[partner], named[partner][0]
    if mine == theirs:
        return f"the same losses as '{name}', bitwise"
    worst = max(abs(a - b) / abs(b) for a, b in zip(mine, theirs))
    if worst <= SAME_LOSSES_RTOL:
        return f"the same losses as '{name}' within {worst:.1e} relative (not bitwise)"
    return f"losses differ from '{name}': up to {worst:.2e} relative"


def timed_steps(fn, steps: int, cuda: bool = True) -> float:
    """Seconds for `steps` calls of `fn`, the GPU (`cuda`) idle at the start and at the end."""
    import torch
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def interleaved_rounds(steps: dict, rounds: int, steps_per_round: int, cuda: bool) -> dict[object, list[float]]:
    """Seconds per step of each of `steps` ({key: a built, warmed-up Step}) in each round: every round runs
    `steps_per_round` steps of each in turn, so a drift of the machine's speed reaches every variant alike."""
    times: dict[object, list[float]] = {key: [] for key in steps}
    for _ in range(rounds):
        for key, step in steps.items():
            times[key].append(timed_steps(step, steps_per_round, cuda) / steps_per_round)
    return times


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


def host_syncs_per_step(step) -> int:
    """The synchronising CUDA calls one call of `step` makes, as torch's sync debug mode warns of them (a scalar or
    data-dependent read, a blocking copy to the host): the step's host synchronisations."""
    import warnings

    import torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    return sum(1 for w in caught if "synchronizing" in str(w.message))


def free_cuda() -> None:
    import torch
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _measure_step(name: str, build, tokens_per_step: int, warmup: int, timed: int) -> dict:
    """One variant's figures: tokens/s, ms/step, first step, peak memory, kernels per step and their time (its
    per-op table goes to this part's log, logs/bench_gpt2.log) and the last loss."""
    import torch
    from bench.baselines import step_profile

    step = None
    try:
        free_cuda()
        base = torch.cuda.memory_allocated()
        step = build()
        first = timed_steps(step, 1)  # compilation, Triton autotuning and allocator warm-up happen here
        timed_steps(step, warmup - 1)
        seconds = timed_steps(step, timed)
        peak_bytes = torch.cuda.max_memory_allocated() - base
        profiled = step_profile(step, cuda=True)
        print(f"== {name}: one step by self CUDA time ({profiled.ops} kernels) ==\n{profiled.table}", flush=True)
        syncs = host_syncs_per_step(step)
        ms_per_step = seconds / timed * 1000
        return {"tps": tokens_per_step * timed / seconds, "ms/step": round(ms_per_step, 2),
                "first step s": round(first, 1), "peak GiB": round(peak_bytes / 2 ** 30, 2),
                "kernels/step": profiled.ops, "host launches/step": profiled.launches,
                "CUDA graph launches/step": profiled.graph_launches, "kernel ms/step": round(profiled.kernel_ms, 2),
                "GPU busy": round(profiled.kernel_ms / ms_per_step, 3), "host syncs/step": syncs,
                "losses": [float(x) for x in step.losses[-timed:]]}
    finally:
        del step
        free_cuda()


def bench_gpt2(args, result: Result) -> str:
    import torch
    from mpzero.parallel import init_parallel
    from mpzero.training import datasheet_bf16_tflops

    shape, batch, warmup, timed = GPT2_124M, args.micro_batch_size, 3, 10
    seq, tokens_per_step = shape.seq_length, args.micro_batch_size * shape.seq_length
    torch.cuda.set_device(0)
    peak = matmul_peak_tflops()
    device_name = torch.cuda.get_device_name(0)
    datasheet = datasheet_bf16_tflops(device_name)
    flops_config = gpt_config(shape, cross_entropy_chunk_size=0)  # model FLOPs: no recomputed logits
    flops_per_token, padded_vocab = flops_config.flops_per_token(), flops_config.padded_vocab_size(1)
    result.note(f"bf16 matmul peak measured in this run: {peak:.0f} TFLOP/s ([8192, 8192] x [8192, 8192] "
                f"torch.matmul, median of 20); MFU = {flops_per_token / 1e6:.0f} MFLOP/token (Megatron's "
                f"72 l h^2 (1 + s/6h + V/12lh), vocab {padded_vocab}) x tokens/s / that peak")
    result.note(f"MFU (datasheet): the same over {device_name}'s datasheet dense bf16 peak, {datasheet:g} TFLOP/s "
                f"(mpzero.training.peak_flops; the training log's MFU)" if datasheet else
                f"MFU (datasheet): no datasheet peak known for {device_name} (mpzero.training.peak_flops)")
    result.note("kernels/step: CUDA kernels run in one step (torch.profiler); host launches/step: the host's calls "
                "that start them (kernel, memcpy/memset and CUDA graph launches: a graph replays many kernels with "
                "one); kernel ms/step: their summed "
                "time; GPU busy: that over ms/step (below 1: the GPU waited for the host, whose launches, Python "
                "and synchronisations were the step's critical path); each variant's per-op breakdown of that "
                "step is in this part's log")
    result.note(f"GPT-2 124M: 12 layers, hidden 768, 12 heads, seq {seq}, micro-batch {batch} ({tokens_per_step} "
                f"tokens/step), dropout 0, AdamW (lr 6e-4, betas 0.9/0.95, wd 0.1), clip 1.0; {warmup} warm-up "
                f"+ {timed} timed steps; peak memory = torch.cuda.max_memory_allocated from model build to the "
                f"last step")
    tokens = torch.randint(0, shape.vocab_size, (batch, seq + 1), device="cuda")
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    groups = init_parallel(1)  # NCCL, a world of one

    def throughput(tps: float) -> dict:
        return {"TFLOP/s": round(flops_per_token * tps / 1e12, 1),
                "MFU": round(flops_per_token * tps / (peak * 1e12), 3),
                **({"MFU (datasheet)": round(flops_per_token * tps / (datasheet * 1e12), 3)} if datasheet else {})}

    eager_tps, ok, measured = None, True, {}
    named = variants(shape, groups, inputs, labels)
    for index, (name, build) in enumerate(named):
        if args.limit - result.elapsed() < 45:
            result.row(model=name, ok=False, note="not run: out of time")
            ok = False
            continue
        try:
            figures = _measure_step(name, build, tokens_per_step, warmup, timed)
        except Exception as error:  # noqa: BLE001
            result.row(model=name, ok=False, note=error_text(error))
            ok = False
            continue
        tps, final = figures.pop("tps"), figures.pop("losses")
        measured[index] = final
        good, notes = all(math.isfinite(x) for x in final), []
        same = _same_losses_note(index, measured, named)
        if same is not None:
            notes.append(same)
            good = good and same.startswith("the same losses")
        if index in GRAPHED and not figures["CUDA graph launches/step"]:  # inductor can still give up at run time
            notes.append("no CUDA graph launched in the profiled step")
            good = False
        if index in NO_SYNC and figures["host syncs/step"]:
            notes.append(f"{figures['host syncs/step']} host synchronisations in a step that should have none "
                         f"(the part's log names them: torch's sync debug warnings)")
            good = False
        if notes:
            figures["note"] = "; ".join(notes)
        eager_tps = tps if eager_tps is None else eager_tps
        result.row(model=name, **{"tokens/s": round(tps), **figures, **throughput(tps),
                                  "vs eager": round(tps / eager_tps, 3), "last loss": round(final[-1], 4)},
                   ok=good)
        ok = ok and good
    rounds_ok = _interleaved(named, tokens_per_step, throughput, args, result)
    return "pass" if ok and rounds_ok else "fail"


# eager + torch.compile, mpzero --torch-compile, the CUDA-graphed steps (the last launched with no host sync)
ROUNDS_VARIANTS = (2, 3, 4, 5, 11)
ROUNDS, ROUND_STEPS = 6, 10
ROUNDS_MIN_S = 110  # five builds (compiled from the warm caches the windows left), their warm-up, 300 steps


def _interleaved(named: list, tokens_per_step: int, throughput: Callable, args, result: Result,
                 indices: tuple[int, ...] = ROUNDS_VARIANTS) -> bool:
    """Variants `indices` (the goal's) again, built together and timed in interleaved rounds (a row each,
    "interleaved: ..."), if the part has `ROUNDS_MIN_S` left; else a note. False if they failed."""
    left = args.limit - result.elapsed()
    if left < ROUNDS_MIN_S:
        result.note(f"interleaved rounds not run: {left:.0f} s of the part's limit left, they need {ROUNDS_MIN_S} "
                    f"(python -m bench.bench_rounds --variants {' '.join(map(str, indices))} runs them)")
        return True
    steps = {}
    try:
        for index in indices:
            steps[index] = named[index][1]()
            timed_steps(steps[index], 3)  # compilation, autotuning, CUDA graph recording
        times = interleaved_rounds(steps, ROUNDS, ROUND_STEPS, cuda=True)
    except Exception as error:  # noqa: BLE001
        result.row(model="interleaved rounds", ok=False, note=error_text(error))
        return False
    finally:
        steps.clear()
        free_cuda()
    first = statistics.median(times[indices[0]])
    for index, seconds in times.items():
        median = statistics.median(seconds)
        result.row(model=f"interleaved: {named[index][0]}", **{
            "tokens/s": round(tokens_per_step / median), "ms/step": round(median * 1e3, 2),
            **throughput(tokens_per_step / median), "ok": True,
            "note": f"median of {ROUNDS} rounds of {ROUND_STEPS} steps, the {len(times)} variants in turn "
                    f"({min(seconds) * 1e3:.2f}-{max(seconds) * 1e3:.2f} ms); x{first / median:.3f} of "
                    f"{named[indices[0]][0]}'s"})
    return True
