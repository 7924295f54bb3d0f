"""`pretrain_gpt.py --dry-run --world-size N --rank R`: the real model and ZeRO optimizer of one rank of an N-rank
job, one iteration on tensors without data and a fake process group.

- It prints the lines the real run prints: the same `zero memory` (at start and with stage 3's peak), `zero comm`
  and `activation memory` lines, character for character, as a 4-rank gloo run of the same flags.
- At scale: GPT-3 175B at TP 8 x DP 64 and a 1T-parameter GPT on 512 ranks with ZeRO-3, every figure equal to the
  planner's (model states, peak, DP and TP bytes, activations), and equal to what tools/plan_memory.py predicts
  for that layout; nothing is allocated (peak RSS stays that of an idle torch process).
- Both engines (meta tensors, torch's FakeTensorMode) print the same lines; bad flags are one line, exit 2.
"""

import json
import subprocess
import sys

import pytest
import torch.distributed as dist

import pretrain_gpt
from mpzero.cli.arguments import parse_args, run_config
from mpzero.cli.dry_run import dry_run
from tests.cli import ROOT, TINY, exit_code_and_stderr, main_capturing_stdout
from tests.distributed import run_ranks
from tests.fp8_marks import needs_cpu_rowwise
from tests.test_planner import _plan

LAYOUT = ["--tensor-model-parallel-size", "2", "--zero-stage", "3", "--bf16", "--train-iters", "1",
          "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--sequence-parallel", "--recompute-activations",
          "--cross-entropy-chunk-size", "5"]  # 32 tokens a micro-batch: six chunks recomputed, the last (2) kept
KINDS = ("zero memory", "zero comm", "activation memory rank 0 ", "activation memory rank 3 ")


def _lines(stdout: str, kind: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(kind)]


@pytest.mark.parametrize("grads", [[], ["--grad-reduce-in-bf16"],
                                   pytest.param(["--fp8-format", "e4m3", "--fp8-recipe", "rowwise"],
                                                marks=needs_cpu_rowwise),
                                   ["--fp8-format", "hybrid", "--fp8-param-gather"]],
                         ids=["fp32-grads", "bf16-grads", "fp8-rowwise", "fp8-gather"])  # FP8: its amaxes' TP
# all-reduces; --fp8-param-gather: ZeRO-3's float8 payloads, buffers and amaxes
def test_dry_run_prints_the_lines_of_the_real_run(grads):
    argv = TINY + LAYOUT + grads
    real = run_ranks(4, main_capturing_stdout, argv)[0][1]  # rank 0 prints every rank's activation line
    for rank in (0, 3):
        _, dry = main_capturing_stdout(argv + ["--dry-run", "--world-size", "4", "--rank", str(rank)])
        assert "| equal" in _lines(dry, "planner |")[0]
        kinds = KINDS if rank == 0 else KINDS[3:]  # only rank 0's memory and comm lines are printed by a real run
        for kind in kinds:
            if kind.startswith("activation") and not kind.endswith(f"rank {rank} "):
                continue
            assert _lines(dry, kind) == _lines(real, kind) and _lines(real, kind), (rank, kind)
    assert len(_lines(real, "zero memory")) == 2  # at start, and with the peak after the first iteration


@pytest.mark.parametrize("layout", [LAYOUT, [f for f in LAYOUT if f != "--recompute-activations"]
                                    + ["--attention-dropout", "0"]], ids=["local", "flash"])
def test_both_engines_print_the_same_lines(capsys, layout):
    """flash: without attention dropout a CPU takes SDPA's flash kernel, and so do meta tensors (torch's choice has no
    meta case; planner.fake), which otherwise kept the math path's scores: 7,680 B more per layer here."""
    run = run_config(parse_args(TINY + layout), 4)
    outputs = []
    for engine in ("meta", "fake"):
        try:
            result = dry_run(run, pretrain_gpt.gpt_provider, 4, 1, engine=engine)
        finally:
            dist.destroy_process_group()
        assert result["equal"]
        lines = capsys.readouterr().out.splitlines()
        outputs.append([line for line in lines if line.startswith(("zero", "activation"))])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 4


GPT3 = ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
        "--vocab-size", "51200", "--micro-batch-size", "1", "--bf16"]
ONE_T = ["--num-layers", "128", "--hidden-size", "25600", "--num-attention-heads", "160", "--seq-length", "2048",
         "--vocab-size", "51200", "--micro-batch-size", "1", "--bf16"]
GPT3_LAYOUT = ["--tensor-model-parallel-size", "8", "--zero-stage", "1", "--recompute-activations",
               "--sequence-parallel"]
ONE_T_LAYOUT = ["--tensor-model-parallel-size", "8", "--zero-stage", "3", "--recompute-activations",
                "--sequence-parallel"]
TRAINING = ["--train-iters", "1", "--lr", "1e-4", "--mock-data", "--global-batch-size", "64"]
AT_SCALE = """
import contextlib, io, json, resource, sys, time
import pretrain_gpt
runs = []
for argv in json.loads(sys.argv[1]):
    out, start = io.StringIO(), time.perf_counter()
    with contextlib.redirect_stdout(out):
        pretrain_gpt.main(argv)
    runs.append({"stdout": out.getvalue(), "seconds": time.perf_counter() - start})
print(json.dumps({"runs": runs, "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def test_175b_and_1t_dry_runs_equal_the_plan_and_allocate_nothing():
    runs = [GPT3 + GPT3_LAYOUT + TRAINING + ["--dry-run", "--world-size", "512", "--rank", "9"],
            ONE_T + ONE_T_LAYOUT + TRAINING + ["--dry-run", "--world-size", "512", "--rank", "511"]]
    out = subprocess.run([sys.executable, "-c", AT_SCALE, json.dumps(runs)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["max_rss"] < 1.5 * 2 ** 30  # an idle torch process: no model state, no activation allocated
    (gpt3, one_t) = (r["stdout"] for r in result["runs"])
    for stdout, params_per_tp_rank in ((gpt3, 21_855_215_616), (one_t, 126_067_968_000)):
        assert _lines(stdout, "planner |")[0].endswith("| equal")
        assert f"params {params_per_tp_rank} " in _lines(stdout, "zero memory")[0]
    assert 174e9 < 8 * 21_855_215_616 < 176e9 and 1.0e12 < 8 * 126_067_968_000 < 1.02e12
    assert "peak bytes" in _lines(one_t, "zero memory")[1]
    # tools/plan_memory.py predicts these lines for the layout (--device cpu: the dry run's device type)
    for model, layout, stdout in ((GPT3, GPT3_LAYOUT, gpt3), (ONE_T, ONE_T_LAYOUT, one_t)):
        stage = layout[layout.index("--zero-stage") + 1]
        code, planned, _ = _plan("--world-size", "512", "--device-memory", "80GiB", "--device", "cpu", "--json",
                                 "--tp-sizes", "8", "--pp-sizes", "1", "--zero-stages", stage, "--offload-tiers",
                                 "none", "--recompute-modes", "selective", "--micro-batch-sizes", "1",
                                 *model, "--global-batch-size", "64")
        assert code == 0
        (sp,) = [x for x in json.loads(planned)["layouts"]
                 if x["layout"]["sequence_parallel"] and x["layout"]["units"] == "layer"]
        # the planner's line is DP rank 0's; at stage 3 the host's construction draws are the parameters this rank's
        # shard overlaps, its own (the dry run's `planner |` line above compares them for its rank): all else equal
        assert _rank_free(sp["zero_memory_line"]) == _rank_free(_lines(stdout, "zero memory")[-1])
        assert sp["zero_comm_line"] == _lines(stdout, "zero comm")[0]
        counted = int(_lines(stdout, "activation memory")[0].split("| micro-batch ")[1].split(" B")[0].replace(",", ""))
        assert sp["activations_saved"] == counted


def _rank_free(line: str) -> str:
    return " | ".join(f for f in line.split(" | ") if not f.startswith("construction-host-working-set"))


def test_bad_flags_are_one_line():
    cases = [(["--world-size", "4"], "describe the job a --dry-run simulates"),
             (["--dry-run", "--world-size", "4", "--rank", "4"], "must lie in [0, --world-size 4)"),
             (["--dry-run", "--world-size", "4", "--zero-stage", "2", "--offload-optimizer", "disk",
               "--offload-path", "/tmp"], "the disk tier would write real files"),
             (["--dry-run", "--world-size", "6", "--tensor-model-parallel-size", "4"], "not divisible"),
             (["--dry-run", "--torch-compile"], "drop --torch-compile from the dry run"),
             (["--dry-run", "--cross-entropy-loss-fusion"], "drop --cross-entropy-loss-fusion from the dry run")]
    for flags, message in cases:
        code, stderr = exit_code_and_stderr(TINY + flags)
        assert code == 2 and message in stderr and stderr.count("\n") == 1, (flags, stderr)


def test_a_dry_run_touches_nothing_on_disk(tmp_path):
    """Its output paths are checked as the flags' types (a path under a file is refused), never created."""
    outputs = ["--save", str(tmp_path / "ckpt"), "--tensorboard-dir", str(tmp_path / "tb"), "--data-cache-path",
               str(tmp_path / "cache")]
    main_capturing_stdout(TINY + ["--dry-run", "--world-size", "2"] + outputs)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("")
    code, stderr = exit_code_and_stderr(TINY + ["--dry-run", "--save", str(tmp_path / "file" / "ckpt")])
    assert code == 2 and stderr.startswith("error: --save ") and "is not a writable directory" in stderr
    assert [p.name for p in tmp_path.iterdir()] == ["file"]
    code, stderr = exit_code_and_stderr(TINY + ["--dry-run", "--world-size", "0"])
    assert code == 2 and stderr == "error: --world-size 0 is out of range: it must be >= 1\n"


# --- pipeline parallelism: a rank of a 3-D job builds its stage and runs its schedule ------------------------------

THREE_D = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
           "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "1", "--lr", "1e-3",
           "--mock-data", "--vocab-size", "300", "--log-interval", "1", "--eval-iters", "0",
           "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def test_a_3d_dry_run_prints_the_lines_of_the_real_run():
    """TP 2 x PP 2 x DP 2, bf16, sequence parallel, selective recomputation, ZeRO-1: a dry run of the first stage's
    rank 1 and the last stage's rank 6 prints the activation line (its stage's layers and micro-batches in flight)
    and the `pipeline comm` line of the 8-rank gloo run character for character, and the planner's figures equal
    them."""
    argv = THREE_D + ["--bf16", "--sequence-parallel", "--recompute-activations", "--zero-stage", "1"]
    real = "".join(out for _, out in run_ranks(8, main_capturing_stdout, argv))  # the logging rank's lines
    for rank in (1, 6):
        _, dry = main_capturing_stdout(argv + ["--dry-run", "--world-size", "8", "--rank", str(rank)])
        kind = f"activation memory rank {rank} "
        assert _lines(dry, kind) == _lines(real, kind) and "in flight (1f1b" in _lines(real, kind)[0]
        (pipeline,) = _lines(dry, "pipeline comm")  # the run prints every stage's at each log interval
        assert pipeline in _lines(real, "pipeline comm") and pipeline.endswith("ratio 1.0000")
        checks = _lines(dry, "planner |")[0]
        assert checks.endswith("| equal") and "pipeline bytes/iter" in checks and "in-flight activation" in checks


@pytest.mark.parametrize("flags", [["--num-virtual-stages-per-pipeline-rank", "2"], ["--enable-zero-bubble"]],
                         ids=["interleaved", "zb-h1"])
def test_every_pipeline_rank_of_a_schedule_is_equal_to_the_plan(flags):
    for rank in range(0, 8, 3):
        _, dry = main_capturing_stdout(THREE_D + flags + ["--dry-run", "--world-size", "8", "--rank", str(rank)])
        assert _lines(dry, "planner |")[0].endswith("| equal"), (rank, dry)


def test_the_planners_pipeline_layout_is_the_dry_runs():
    """tools/plan_memory.py's figures for a TP 2 x PP 2 x DP 2 layout are those of the dry run of the pipeline rank
    it shows (the largest device peak): its zero memory and comm lines, held activations, pipeline bytes."""
    code, planned, _ = _plan("--world-size", "8", "--device-memory", "1GiB", "--device", "cpu", "--json",
                             "--tp-sizes", "2", "--pp-sizes", "2", "--virtual-stages", "2", "--zero-bubble", "no",
                             "--zero-stages", "1", "--offload-tiers", "none", "--recompute-modes", "none",
                             "--micro-batch-sizes", "2", *THREE_D[:THREE_D.index("--tensor-model-parallel-size")])
    assert code == 0
    layouts = json.loads(planned)["layouts"]
    assert {x["layout"]["virtual_stages"] for x in layouts} == {1, 2} and all(x["layout"]["pp"] == 2 for x in layouts)
    for x in layouts:
        layout = x["layout"]
        flags = (["--zero-stage", "1"] + (["--sequence-parallel"] if layout["sequence_parallel"] else [])
                 + (["--num-virtual-stages-per-pipeline-rank", "2"] if layout["virtual_stages"] > 1 else []))
        rank = x["pipeline_rank"] * 4  # TP rank 0, DP rank 0 of that pipeline rank (PP outermost)
        _, dry = main_capturing_stdout(THREE_D + flags + ["--dry-run", "--world-size", "8", "--rank", str(rank)])
        assert x["zero_memory_line"] == _lines(dry, "zero memory")[-1]
        if layout["virtual_stages"] == 1:  # interleaved: ZeRO counts each chunk's backward as a micro-batch
            assert x["zero_comm_line"] == _lines(dry, "zero comm")[0]
        checks = _lines(dry, "planner |")[0]
        assert f"in-flight activation bytes {x['activations_held']} vs" in checks
        assert f"pipeline bytes/iter {x['pp_bytes_per_iter']:.0f} vs" in checks


@pytest.mark.product  # about 2 minutes here: 512 micro-batches through two 1T layers
def test_rank_3000_of_ptdps_1t_run_equals_the_plan():
    """PTD-P's 1T run (TP 8 x PP 64 x DP 6 on 3072 GPUs, batch 3072): rank 3000 is pipeline rank 62."""
    argv = ONE_T + ["--train-iters", "1", "--lr", "1e-4", "--mock-data", "--global-batch-size", "3072",
                    "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "64", "--zero-stage", "1",
                    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
                    "--sequence-parallel", "--dry-run", "--world-size", "3072", "--rank", "3000"]
    _, dry = main_capturing_stdout(argv)
    assert "pipeline rank 62" in dry and _lines(dry, "planner |")[0].endswith("| equal")
