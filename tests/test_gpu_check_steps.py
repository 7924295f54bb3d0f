"""What `make gpu-check` measures for issue 46, run on the CPU first: bench_fp8 end to end at a tiny shape, eagerly,
with the CUDA calls stubbed (its LLaMA variants, bf16 and each torchao recipe, build, train and end within 3% of
bf16's loss); bench_gpt2's step launched with no host synchronisation gives the synchronising step's losses bit for
bit."""

import argparse
import json
import math

import torch

from tests.distributed import run_ranks
from tests.fp8_marks import needs_cpu_rowwise
from tests.gpu.check import fp8_bench, gpt2_step, workers

TINY = fp8_bench.LlamaShape(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=32,
                            vocab_size=300)


def _bench_fp8_on_the_cpu(path: str):
    """The part end to end at the tiny shape, eagerly, with the CUDA calls stubbed (0 bytes, no syncs counted)."""
    from tests.gpu.check.result import Result
    for name in ("set_device", "synchronize", "empty_cache", "reset_peak_memory_stats"):
        setattr(torch.cuda, name, lambda *args, **kwargs: None)
    torch.cuda.memory_allocated = torch.cuda.max_memory_allocated = lambda *args, **kwargs: 0
    gpt2_step.matmul_peak_tflops = lambda: 1.0
    gpt2_step.host_syncs_per_step = lambda step: step() or 0
    fp8_bench.LLAMA_1B, fp8_bench.COMPILED, fp8_bench.STEPS, fp8_bench.TIMED = TINY, False, 8, 3
    status = fp8_bench.bench_fp8(argparse.Namespace(limit=300), Result(path, workers.COLUMNS["bench_fp8"]))
    return status, json.load(open(path))


@needs_cpu_rowwise  # the part runs every recipe
def test_bench_fp8_part_runs_end_to_end_on_the_cpu(tmp_path):
    status, data = run_ranks(1, _bench_fp8_on_the_cpu, str(tmp_path / "fp8.json"), deadline=240)[0]
    rows = data["rows"]
    assert status == "pass" and [row["recipe"] for row in rows] == list(fp8_bench.RECIPES)
    for row in rows:
        assert set(row) <= set(workers.COLUMNS["bench_fp8"]) and row["ok"] and row["tokens/s"] > 0
    assert all(row["note"].startswith("goal ") and "vs bf16" in row for row in rows[1:])
    assert data["notes"][0].startswith("LLaMA ~1B: LlamaShape(num_layers=2")


def _launched_and_synchronising() -> tuple[list[float], list[float]]:
    from mpzero.parallel import init_parallel
    groups = init_parallel(1)
    shape = gpt2_step.Shape(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=200)
    tokens = torch.randint(0, shape.vocab_size, (2, shape.seq_length + 1), generator=torch.Generator().manual_seed(0))
    losses = []
    for launched in (True, False):
        step = gpt2_step.mpzero_step(shape, groups, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), "auto",
                                     launched=launched)
        for _ in range(3):
            step()
        losses.append([float(x) for x in step.losses])
    return tuple(losses)


def test_the_launched_gpt2_step_is_the_synchronising_one():
    launched, synchronising = run_ranks(1, _launched_and_synchronising)[0]
    assert launched == synchronising and launched[2] < launched[0]
