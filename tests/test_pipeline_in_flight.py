"""A pipeline stage's activation memory, counted = formula: what one micro-batch's forward keeps on each stage (its
own layers, the embedding's terms on the first stage, the head's and the loss's on the last, nothing outside the
layers on a middle stage), and the micro-batches a stage holds at once, counted by the executor against the
schedule's closed form (1F1B p - i, interleaved Megatron's 2(p - i - 1) + (v - 1)p + 1 chunk micro-batches, ZB-H1
p - i plus the i held-back weight gradients, whose inputs the weight-gradient store holds), to the byte, on uneven
first and last stages too (Megatron's estimator divides a model evenly: Megatron-Bridge #5077)."""

import random
import re

import pytest

from mpzero.activations import ActivationSetting, deferred_bytes
from mpzero.pipeline import Pipeline, build, held_formula, simulate
from mpzero.pipeline.in_flight import _peak, schedule_moments
from tests.cli import main_capturing_stdout
from tests.distributed import run_ranks

BASE = ["--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--vocab-size", "128", "--log-interval", "1",
        "--eval-iters", "0"]
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--no-position-embedding",
         "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]
HELD = re.compile(r"in flight \((\S+), stage (\d+) of p (\d+).*?\) (\d+) (?:chunk )?micro-batches counted, formula "
                  r"\S+ = (\d+)")


@pytest.mark.parametrize("p,v", [(p, v) for p in range(1, 9) for v in range(1, 5) if v == 1 or p > 1])
def test_the_schedules_closed_forms_are_what_their_steps_hold(p, v):
    """Megatron's counts against the schedules as data (simulate.py's count of forwards whose backward, or W, has
    not run), for several m; for one chunk per rank, (p - i) M and max((p - i) M + i D, (p - i - 1) M + (i + 1) D)
    against the peak of held bytes over the steps, for any M and D."""
    rng = random.Random(p * 10 + v)
    kinds = ["interleaved"] if v > 1 else ["1f1b", "zb-h1"]
    for kind in kinds:
        for m in sorted({p, 2 * p, 3 * p, p + 1, 1, 4 * p + 3}):
            if (kind == "interleaved" and m % p) or (kind == "zb-h1" and m < p):
                continue
            pipe = Pipeline(p, v, m)
            schedule = build(kind, pipe)
            counts = simulate(pipe, schedule).in_flight
            for rank in range(p):
                assert held_formula(kind, pipe, rank)[0] == counts[rank], (kind, pipe, rank)
                if v == 1:
                    chunk, deferred = rng.randint(1, 10**6), rng.randint(1, 10**6)
                    full = min(p - rank, m)
                    expected = full * chunk
                    if kind == "zb-h1":
                        late = counts[rank] - full
                        expected = max(expected + late * deferred, expected - chunk + (late + 1) * deferred)
                    moments = schedule_moments(schedule[rank], 1)
                    assert _peak(moments, (chunk,), deferred if kind == "zb-h1" else 0) == expected


def test_megatrons_interleaving_penalty_on_the_first_stage():
    """Stage 0 holds p(1 + (p - 1)/(p v)) stages' worth: 2(p - 1) + (v - 1)p + 1 chunk micro-batches of 1/v."""
    for p, v in ((2, 2), (4, 2), (4, 4), (8, 3)):
        held, _ = held_formula("interleaved", Pipeline(p, v, 4 * p), 0)
        assert held / v == p * (1 + (p - 1) / (p * v))


def test_zero_bubbles_deferred_inputs_are_the_papers_32sbh():
    """GPT at TP 1, 2-byte activations: the W pass needs 32 sbh per layer (Qi et al., Table 1)."""
    s, b, h = 2048, 1, 4096
    setting = ActivationSetting(s, b, h, 32, 2, 51200, 51200, dtype_bytes=2)
    assert deferred_bytes(setting) == 2 * 32 * s * b * h


def _lines(argv, world):
    outputs = run_ranks(world, main_capturing_stdout, argv, deadline=300)
    return [line for _, out in outputs for line in out.splitlines() if line.startswith("activation memory rank")]


def _assert_counted_equals_formula(argv, world, kind, p):
    lines = _lines(argv, world)
    assert len(lines) == world, lines
    stages = set()
    for line in lines:
        ratios = re.findall(r"ratio (\S+)", line)
        assert ratios and all(r == "1.0000" for r in ratios), line
        held = HELD.search(line)
        assert held and held.group(1) == kind and int(held.group(3)) == p, line
        assert held.group(4) == held.group(5), line
        stages.add(int(held.group(2)))
    assert stages == set(range(p))
    return lines


def test_uneven_first_and_last_stages_are_exact():
    """8 layers split [1, 2, 2, 3] (the Megatron-Bridge #5077 layout), dropout on, bf16: each stage's micro-batch
    and its p - i held, to the byte; the middle stages keep nothing outside their layers."""
    argv = BASE + ["--num-layers", "8", "--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers",
                   "1", "--decoder-last-pipeline-num-layers", "3", "--global-batch-size", "16", "--bf16"]
    lines = _assert_counted_equals_formula(argv, 4, "1f1b", 4)
    middle = [line for line in lines if "stage 1 of" in line or "stage 2 of" in line]
    assert len(middle) == 2 and all("(outside the layers 0)" in line for line in middle)


def test_zero_bubble_holds_the_deferred_weight_gradients_inputs():
    """TP 2 x PP 2, sequence parallel, selective recomputation, LLaMA (GQA, SwiGLU, RoPE): stage 0 holds p
    micro-batches whole; stage 1 one whole and one W's inputs (the store's bytes = the deferred formula)."""
    argv = BASE + LLAMA + ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size",
                           "2", "--sequence-parallel", "--recompute-activations", "--enable-zero-bubble",
                           "--global-batch-size", "8", "--hidden-dropout", "0", "--attention-dropout", "0"]
    lines = _assert_counted_equals_formula(argv, 4, "zb-h1", 2)
    assert all("weight-gradient store 0)" in line for line in lines if "stage 0 of" in line)
    assert all("weight-gradient store 0)" not in line for line in lines if "stage 1 of" in line)


def test_interleaved_chunks_with_block_recomputation_per_chunk():
    """PP 2 x v 2, full recomputation block 1 applied per model chunk (each chunk's first layer recomputed),
    GPT-2 with its tied embedding copy on the last stage."""
    argv = BASE + ["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank",
                   "2", "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers",
                   "1", "--global-batch-size", "8", "--hidden-dropout", "0.1", "--attention-dropout", "0"]
    lines = _assert_counted_equals_formula(argv, 2, "interleaved", 2)
    assert "layers 0,4 (checkpoint)" in lines[0] and "layers 1,5 (stored)" in lines[0]


@pytest.mark.parametrize("kind,flags", [
    ("interleaved", ["--pipeline-model-parallel-size", "4", "--num-layers", "8",
                     "--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "16", "--fp16"]),
    ("zb-h1", ["--pipeline-model-parallel-size", "4", "--num-layers", "8", "--enable-zero-bubble",
               "--global-batch-size", "16", "--recompute-granularity", "full", "--recompute-method", "uniform",
               "--recompute-num-layers", "2"]),
    ("1f1b", ["--pipeline-model-parallel-size", "4", "--num-layers", "6", "--account-for-embedding-in-pipeline-split",
              "--account-for-loss-in-pipeline-split", "--global-batch-size", "4", "--cross-entropy-chunk-size", "0"]),
], ids=["interleaved-p4-fp16", "zb-h1-p4-full-uniform", "1f1b-accounted-m-below-p"])
def test_more_schedules_and_splits(kind, flags):
    _assert_counted_equals_formula(BASE + flags, 4, kind, 4)
