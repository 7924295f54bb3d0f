"""`make gpu-check` without a GPU: one line, exit 0, and a report that names every part (all skipped) written
atomically into OUT; the report builder and validator on made-up results; the multi-GPU layouts; the
JUnit parsing of pytest parts; bench_gpt2's variants trained at a tiny shape on the CPU."""

import contextlib
import io
import json
import math
import os
import subprocess
import sys

import pytest

from tests.distributed import run_ranks
from tests.gpu.check import cli, gpt2_step, report, workers
from tests.gpu.check.report import PART_NAMES, PARTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dry_run_without_cuda_says_so_in_one_line_and_writes_a_valid_report(tmp_path):
    out = tmp_path / "gpu-report"
    env = {**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, even on a GPU machine
    proc = subprocess.run([sys.executable, "-m", "tests.gpu.check", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA here"), proc.stdout
    text = (out / "report.md").read_text()
    data = json.loads((out / "report.json").read_text())
    assert [p["name"] for p in data["parts"]] == PART_NAMES
    report.validate(text, data["parts"])
    for part in PARTS:
        assert f"## {part.name}: {part.title}" in text
        assert f"| {part.name} | skipped: no CUDA |" in text
    assert "| torch |" in text and "| GPUs | 0 |" in text
    assert sorted(os.listdir(out)) == ["logs", "report.json", "report.md"]  # no temporary file left


def test_report_is_written_atomically_into_out(tmp_path, monkeypatch):
    renames = []
    real_replace = os.replace

    def recording_replace(src, dst):
        renames.append((str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", recording_replace)
    path = report.write(str(tmp_path), {"device": "none"}, report.skipped_results("no CUDA"), 0.5)
    assert path == str(tmp_path / "report.md")
    targets = [dst for _, dst in renames]
    assert targets == [str(tmp_path / "report.json"), path]
    for src, dst in renames:  # a temporary beside the target, renamed over it
        assert os.path.dirname(src) == os.path.dirname(dst) and src != dst


def test_a_failed_write_leaves_the_previous_report(tmp_path, monkeypatch):
    path = report.write(str(tmp_path), {}, report.skipped_results("no CUDA"), 0.0)
    before = open(path).read()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        report.write(str(tmp_path), {}, report.skipped_results("other"), 0.0)
    assert open(path).read() == before
    assert sorted(os.listdir(tmp_path)) == ["report.json", "report.md"]


def test_report_shows_figures_statuses_and_logs():
    results = report.skipped_results("not selected (--only)")
    results[6] = {**results[6], "status": "pass", "seconds": 61.2, "logs": ["out/logs/bench_gpt2.log"],
                  "columns": ["model", "tokens/s", "ok"], "rows": [{"model": "eager | SDPA", "tokens/s": 123456.0,
                                                                    "ok": True}], "notes": ["peak 700 TFLOP/s"]}
    results[0] = {**results[0], "status": "timeout: killed after 150 s"}
    text = report.render({"device": "1 x H100"}, results, 70.0, "out")
    report.validate(text, results)
    assert "| eager \\| SDPA | 123,456 | True |" in text
    assert "- raw logs: `out/logs/bench_gpt2.log`" in text and "- peak 700 TFLOP/s" in text
    assert "| fused_kernels | timeout: killed after 150 s |" in text


@pytest.mark.parametrize("damage", ["drop a part", "unknown status", "reorder"])
def test_validate_refuses_a_broken_report(damage):
    results = report.skipped_results("no CUDA")
    text = report.render({}, results, 0.0, "out")
    if damage == "drop a part":
        text = text.replace(f"## {PARTS[3].name}: {PARTS[3].title}", "## gone")
    elif damage == "unknown status":
        results[2] = {**results[2], "status": "maybe"}
    else:
        results = results[::-1]
    with pytest.raises(ValueError):
        report.validate(text, results)


def test_arguments():
    assert cli.parse_args([]).out == "gpu-report" and cli.parse_args([]).budget == 540
    assert cli.parse_args(["--only", "bench_gpt2", "zero_nccl"]).only == ["bench_gpt2", "zero_nccl"]
    with pytest.raises(SystemExit):
        cli.parse_args(["--only", "nonsense"])
    with pytest.raises(SystemExit):
        cli.parse_args(["--budget", "0"])


def test_every_part_has_a_runner_within_the_ten_minute_budget():
    for part in PARTS:
        assert part.name in cli.PYTEST_FILES or part.name in workers.PARTS or part.name == "bench_kernels"
        assert 0 < part.limit_s <= 300
    for files in cli.PYTEST_FILES.values():
        assert all(os.path.isfile(os.path.join(ROOT, f)) for f in files)
    assert cli.parse_args([]).budget + 30 < 10 * 60  # start-up and report included: one device command's limit


def test_multi_gpu_layouts():
    assert workers.multi_gpu_layouts(1) == []
    assert workers.multi_gpu_layouts(2) == [(2, 2, 1), (2, 1, 1), (2, 1, 2), (2, 1, 3)]
    assert workers.multi_gpu_layouts(8) == [(4, 2, 1), (4, 2, 2), (4, 2, 3)]


def test_pytest_junit_results_become_rows(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text("""<?xml version="1.0"?><testsuites><testsuite>
<testcase classname="tests.gpu.test_x" name="test_a[fp16]" time="1.5"/>
<testcase classname="tests.gpu.test_x" name="test_a[bf16]" time="0.5"><failure message="boom">trace</failure></testcase>
<testcase classname="tests.gpu.test_x" name="test_b" time="0"><skipped message="needs 2 GPUs"/></testcase>
</testsuite></testsuites>""")
    counts, rows, notes = cli.pytest_result(str(xml))
    assert counts == {"passed": 1, "failed": 1, "skipped": 1}
    assert rows == [{"test": "test_x::test_a", "passed": 1, "failed": 1, "skipped": 0, "seconds": 2.0},
                    {"test": "test_x::test_b", "passed": 0, "failed": 0, "skipped": 1, "seconds": 0.0}]
    assert notes == ["FAILED test_x::test_a[bf16]: boom"]


def test_a_part_past_its_limit_is_killed_with_its_process_group(tmp_path):
    log = str(tmp_path / "part.log")
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "time.sleep(60)")
    rc, seconds = cli.run_logged([sys.executable, "-c", code], log, 1, cli.child_env())
    assert rc is None and seconds < 15
    assert "killed after the 1 s limit" in open(log).read()


TINY = gpt2_step.Shape(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=200)
# bench_gpt2's variants by index: eager, mpzero auto, mpzero local; the compiled ones: eager + compile, mpzero's
# trunk as one region, the same with --cuda-graph-impl local, and with the loss in one chunk too, the trunk with
# the fused loss, a region per layer, eager + compile reading its norm, the trunk with the loss in one chunk, and
# the CUDA-graphed step launched without a host synchronisation
PLAIN, COMPILED = (0, 1, 7), (2, 3, 4, 5, 6, 8, 9, 10, 11)
BF16_RTOL = 2e-3  # bf16 parameters and activations: other kernels sum in another order (seen: 4e-5)


def _train_variants(picked: tuple[int, ...]) -> dict[int, list[float]]:
    """Three steps of each picked variant (build and step exactly as bench_gpt2 does) on one batch; their losses."""
    import torch
    from mpzero.parallel import init_parallel
    groups = init_parallel(1)
    tokens = torch.randint(0, TINY.vocab_size, (2, TINY.seq_length + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    builds = gpt2_step.variants(TINY, groups, inputs, labels)
    out = {}
    for index in picked:
        step = builds[index][1]()
        for _ in range(3):
            step()
        out[index] = [float(x) for x in step.losses]
    return out


def _assert_trains(losses: list[float]) -> None:
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and losses[2] < losses[1] < losses[0], losses


def test_bench_gpt2_variants_build_and_train_on_the_cpu():
    """What the GPU part times, run here first: eager, and mpzero's ZeRO-1 bf16 step with each attention backend,
    learn the batch, and the backends agree."""
    out = run_ranks(1, _train_variants, PLAIN, deadline=120)[0]
    for losses in out.values():
        _assert_trains(losses)
    assert out[7] == pytest.approx(out[1], rel=BF16_RTOL)


@pytest.mark.product
def test_bench_gpt2_compiled_variants_equal_their_eager_runs_on_the_cpu():
    """The torch.compile variants (inductor's C++ backend here; ~60 s) give their eager variant's losses."""
    out = run_ranks(1, _train_variants, PLAIN[:2] + COMPILED, deadline=400)[0]
    for losses in out.values():
        _assert_trains(losses)
    assert out[2] == pytest.approx(out[0], rel=BF16_RTOL)  # eager + torch.compile
    assert out[9] == out[2]  # reading the norm changes nothing computed
    assert out[10] == out[3]  # at this shape the default chunk holds the whole micro-batch already
    assert out[4] == out[5] == out[11] == out[3]  # no CUDA graphs on the CPU: the same compiled run (11: launched)
    for compiled in (3, 6, 8):  # one region, + the fused loss, a region per layer
        assert out[compiled] == pytest.approx(out[1], rel=BF16_RTOL)


def test_a_variant_replaying_cuda_graphs_must_give_the_compiled_variants_losses():
    named = [(f"variant {i}", None) for i in range(12)]
    note = gpt2_step._same_losses_note
    assert {(3, 4), (10, 5), (4, 11)} <= set(gpt2_step.SAME_LOSSES) and gpt2_step.GRAPHED == (4, 5, 11)
    assert note(4, {4: [2.0, 1.5]}, named) is None and note(2, {2: [2.0], 3: [2.0]}, named) is None
    assert note(4, {3: [2.0, 1.5], 4: [2.0, 1.5]}, named) == "the same losses as 'variant 3', bitwise"
    assert note(10, {5: [2.0, 1.5], 10: [2.0, 1.5]}, named) == "the same losses as 'variant 5', bitwise"
    assert note(4, {3: [2.0, 1.5], 4: [2.0, 1.501]}, named).startswith("the same losses as 'variant 3' within 6.7e-04")
    assert note(4, {3: [2.0, 1.5], 4: [2.0, 1.6]}, named) == "losses differ from 'variant 3': up to 6.67e-02 relative"


def _interleaved_on_the_cpu(path: str, limit: float) -> tuple[bool, dict]:
    """bench_gpt2's closing rounds with its eager variants at the tiny shape, the CUDA calls stubbed: its rows."""
    import argparse

    import torch
    from mpzero.parallel import init_parallel
    from tests.gpu.check.result import Result
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        setattr(torch.cuda, name, lambda *args, **kwargs: None)
    tokens = torch.randint(0, TINY.vocab_size, (2, TINY.seq_length + 1), generator=torch.Generator().manual_seed(0))
    named = gpt2_step.variants(TINY, init_parallel(1), tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    result = Result(path, workers.COLUMNS["bench_gpt2"])
    ok = gpt2_step._interleaved(named, tokens[:, 1:].numel(), lambda tps: {"MFU": 0.5}, argparse.Namespace(limit=limit),
                                result, indices=(0, 1))
    return ok, json.load(open(path))


def test_bench_gpt2_ends_with_interleaved_rounds_when_time_is_left(tmp_path):
    ok, data = run_ranks(1, _interleaved_on_the_cpu, str(tmp_path / "r.json"), 300.0, deadline=120)[0]
    rows, eager = data["rows"], "eager PyTorch (SDPA, autocast bf16, fused AdamW)"
    assert ok and [row["model"] for row in rows] == [f"interleaved: {eager}", "interleaved: mpzero defaults (auto: "
                                                     "flash attention, torch LayerNorm), ZeRO-1 bf16"]
    for row in rows:
        assert row["ms/step"] > 0 and row["ok"] and row["MFU"] == 0.5 and set(row) <= set(workers.COLUMNS["bench_gpt2"])
        assert row["note"].startswith(f"median of {gpt2_step.ROUNDS} rounds of {gpt2_step.ROUND_STEPS} steps, the 2 "
                                      f"variants in turn (") and row["note"].endswith(f" of {eager}'s")
    assert "); x1.000 of " in rows[0]["note"]
    ok, data = run_ranks(1, _interleaved_on_the_cpu, str(tmp_path / "short.json"), 60.0)[0]
    assert ok and not data["rows"] and data["notes"][0].startswith("interleaved rounds not run: ")
    assert data["notes"][0].endswith("they need 110 (python -m bench.bench_rounds --variants 0 1 runs them)")


def _rounds(argv):
    from bench import bench_rounds
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        medians = bench_rounds.main(argv)
    return medians, out.getvalue()


def test_bench_rounds_times_the_picked_variants_in_turn_on_the_cpu():
    """bench/bench_rounds.py (interleaved rounds of gpu-check's variants) at its CPU shape: each picked variant
    gets a median, printed with its ratio to the first."""
    medians, out = run_ranks(1, _rounds, ["--variants", "0", "1", "--rounds", "2", "--steps", "1",
                                          "--micro-batch-size", "2"], deadline=120)[0]
    assert sorted(medians) == [0, 1] and all(t > 0 for t in medians.values())
    assert "x1.000" in out.splitlines()[1] and out.splitlines()[2].startswith("1: ")
    listing = run_ranks(1, _rounds, ["--list"])[0][1]
    assert listing.splitlines()[4].startswith("4: mpzero --torch-compile --cuda-graph-impl local")


def _cross_entropy_cases_on_the_cpu():
    import torch
    from bench.bench_fused_gpu import _cross_entropy_cases
    cases = _cross_entropy_cases(24, 16, 111, 5, torch.float32, device="cpu")
    cases["torch"]()
    return sorted(cases)


def test_bench_kernels_cross_entropy_row_runs_on_the_cpu():
    """bench_fused_gpu.py's cross-entropy row at a tiny shape on the CPU: its cases are the two implementations,
    and the reference's case runs (the compiled one is the same call with impl "compile", equal to it by
    tests/fused/test_fused_cross_entropy.py)."""
    assert run_ranks(1, _cross_entropy_cases_on_the_cpu)[0] == ["compile", "torch"]


def _zero_memory_on_the_cpu(path):
    """zero_memory at a tiny shape with the CUDA allocator's calls stubbed (0 bytes): its own code end to end."""
    import argparse

    import torch
    from tests.gpu.check import memory_check
    from tests.gpu.check.result import Result
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        setattr(torch.cuda, name, lambda *args, **kwargs: None)
    torch.cuda.memory_allocated = torch.cuda.max_memory_allocated = lambda *args, **kwargs: 0
    memory_check.GPT2_124M = gpt2_step.Shape(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                                             vocab_size=300)
    status = memory_check.zero_memory(argparse.Namespace(limit=120), Result(path, workers.COLUMNS["zero_memory"]))
    return status, json.load(open(path))["rows"]


def test_zero_memory_part_runs_its_four_stages_on_the_cpu(tmp_path):
    status, rows = run_ranks(1, _zero_memory_on_the_cpu, str(tmp_path / "zm.json"))[0]
    assert status == "pass" and [row["stage"] for row in rows] == [0, 1, 2, 3]
    for row in rows:
        assert row["counted MiB"] == row["formula MiB"] and row["construction formula MiB"] > row["formula MiB"]
        assert set(row) <= set(workers.COLUMNS["zero_memory"])
