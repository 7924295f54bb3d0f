"""pretrain_gpt end to end: every (TP, DP) layout prints the single-process losses (fp32, no dropout,
within 1e-5 relative: layouts differ only in the order of floating-point sums), and bad sizes are
one-line errors with a non-zero exit."""

import contextlib
import io
import os
import re
import subprocess
import sys

import pytest

import pretrain_gpt

from tests.cli import LINE, ROOT, TINY, assert_close_lists, exit_code_and_stderr, main_capturing_stdout
from tests.distributed import run_ranks


@pytest.fixture(scope="module")
def single_process():
    return run_ranks(1, main_capturing_stdout, TINY)[0]


def test_console_lines_follow_megatron_format(single_process):
    history, stdout = single_process
    lines = [m for m in map(LINE.match, stdout.splitlines()) if m]
    assert len(lines) == 10
    assert stdout.startswith("configuration: {")
    validation = [line for line in stdout.splitlines() if line.startswith(" validation loss at ")]
    assert len(validation) == 4 and validation[-1].startswith(" validation loss at the end of training for test")
    assert re.search(r"\| tokens/s: \d+ \| TFLOP/s/rank: [0-9.]+ \|$", lines[0].string)
    assert re.search(r"^zero memory \| stage 1 \| dp 1 \| .* \| ratio 1\.0\d+ \|", stdout, re.M)
    assert re.search(r'^fused ops \(auto\): \{"adamw_step": "\w+", "attention": "flash", "cross_entropy": "torch", '
                     r'"cuda_graphs": "none", "fp8": "none", "layer_norm"', stdout, re.M)
    assert len(re.findall(r"^zero comm \| stage 1 .* \| ratio \S+$", stdout, re.M)) == 10
    assert [int(m.group(3)) for m in lines] == [8 * i for i in range(1, 11)]
    assert_close_lists([float(m.group(4)) for m in lines], history["losses"], rel=1e-6)
    assert history["losses"][-1] < history["losses"][0]


@pytest.mark.parametrize("tp,dp", [(2, 1), (1, 2), (2, 2)])
def test_layout_losses_match_single_process(single_process, tp, dp):
    results = run_ranks(tp * dp, main_capturing_stdout, TINY + ["--tensor-model-parallel-size", str(tp)])
    history, stdout = results[0]
    reference = single_process[0]
    assert_close_lists(history["losses"], reference["losses"])
    assert_close_lists(history["grad_norms"], reference["grad_norms"])
    printed = [float(m.group(4)) for m in map(LINE.match, stdout.splitlines()) if m]
    assert_close_lists(printed, reference["losses"])
    assert all(r[1] == "" for r in results[1:]), "only rank 0 prints"


@pytest.mark.parametrize("world,extra,message", [
    (3, ["--tensor-model-parallel-size", "2"], "world size 3 is not divisible by --tensor-model-parallel-size 2"),
    (2, ["--tensor-model-parallel-size", "2", "--num-attention-heads", "3", "--hidden-size", "30"],
     "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2"),
    (2, ["--global-batch-size", "6", "--micro-batch-size", "4"],
     "--global-batch-size 6 is not divisible by --micro-batch-size 4 x data-parallel size 2 = 8"),
])
def test_bad_sizes_exit_nonzero_with_one_line_from_one_rank(world, extra, message):
    results = run_ranks(world, exit_code_and_stderr, TINY + extra)
    assert [code for code, _ in results] == [2] * world
    stderr = results[0][1]
    assert stderr.count("\n") == 1 and stderr.startswith("error: ") and message in stderr
    assert all(other == "" for _, other in results[1:]), "the same error is said once, by rank 0"


def test_a_bad_flag_combination_is_reported_before_any_output():
    out = run_ranks(1, main_capturing_stdout_or_exit, TINY + ["--global-batch-size", "7"])[0]
    assert out == (2, ""), out  # no configuration dump before the error


def main_capturing_stdout_or_exit(argv):
    """(exit code, stdout) of a run expected to stop with SystemExit."""
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()):
        try:
            pretrain_gpt.main(argv)
        except SystemExit as stop:
            return stop.code, out.getvalue()
    return 0, out.getvalue()


@pytest.mark.slow
def test_torchrun_tp2_dp2_matches_plain_python(tmp_path):
    """The issue's acceptance command: torchrun with 4 processes at TP=2 against one process at TP=1."""
    def losses(cmd):  # TMPDIR: torchrun's agent keeps its log folders there
        out = subprocess.run(cmd + TINY, cwd=ROOT, capture_output=True, text=True, timeout=240,
                             env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)})
        assert out.returncode == 0, out.stderr[-3000:]
        return [float(m.group(4)) for m in map(LINE.match, out.stdout.splitlines()) if m]

    single = losses([sys.executable, "pretrain_gpt.py"])
    torchrun = losses([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                       "pretrain_gpt.py", "--tensor-model-parallel-size", "2"])
    assert len(single) == 10
    assert_close_lists(torchrun, single)
