"""--attention-backend through the CLI: flash (torch's scaled_dot_product_attention) and unfused (the reference
softmax) train to local's losses (Megatron's core attention, the CPU's default with attention dropout) within 1e-5
relative in fp32 (the same maths in another summation order), at TP 2 with attention dropout drawn from the
tracker's stream, and with selective recomputation replaying it; the resolved backend is printed on the `fused ops`
line (auto on a CPU: flash without attention dropout, local with it); what cannot run is one line. Flash with
dropout on a CPU is torch's math path (its CPU kernel has no dropout), and the run says so at start
(mpzero.fused.sdpa); a GPU run would stop there (tests/gpu/test_gpt_cuda.py)."""

import re

import pytest

from tests.cli import TINY, assert_close_lists, exit_code_and_stderr, main_capturing_stdout
from tests.distributed import run_ranks

FLAGS = TINY + ["--train-iters", "4", "--eval-iters", "0", "--tensor-model-parallel-size", "2",
                "--attention-dropout", "0.1", "--hidden-dropout", "0.1"]


def _run(backend, *extra):
    return run_ranks(2, main_capturing_stdout, FLAGS + ["--attention-backend", backend, *extra])[0]


@pytest.mark.parametrize("extra", [(), ("--recompute-activations",)])
def test_flash_and_unfused_match_local_at_tp2_with_dropout(extra):
    local, stdout = _run("local", *extra)
    assert re.search(r'^fused ops \(auto\): .*"attention": "local"', stdout, re.M)
    assert not re.search(r"^attention: ", stdout, re.M)
    for backend in ("flash", "unfused"):
        history, stdout = _run(backend, *extra)
        assert re.search(rf'^fused ops \(auto\): .*"attention": "{backend}"', stdout, re.M)
        math_note = (r"^attention: --attention-backend flash runs torch's math path on this cpu \(Both fused "
                     r"kernels do not support non-zero dropout\): explicit \[s, s\] scores")
        assert bool(re.search(math_note, stdout, re.M)) == (backend == "flash"), stdout
        assert_close_lists(history["losses"], local["losses"], rel=1e-5)
        assert_close_lists(history["grad_norms"], local["grad_norms"], rel=1e-5)


@pytest.mark.parametrize("dropout, backend", [("0", "flash"), ("0.1", "local")])
def test_auto_on_a_cpu_is_flash_without_attention_dropout_and_local_with_it(dropout, backend):
    stdout = run_ranks(1, main_capturing_stdout, TINY + ["--train-iters", "1", "--eval-iters", "0",
                                                         "--attention-dropout", dropout])[0][1]
    assert re.search(rf'^fused ops \(auto\): .*"attention": "{backend}"', stdout, re.M)
    assert re.search(r"^activation memory rank 0 .* ratio 1\.0000", stdout, re.M)  # the formula follows the choice


def test_use_flash_attn_is_the_flash_backend():
    flash = run_ranks(1, main_capturing_stdout, TINY + ["--train-iters", "2", "--eval-iters", "0",
                                                       "--use-flash-attn"])[0][1]
    assert re.search(r'^fused ops \(auto\): .*"attention": "flash"', flash, re.M)
    assert not re.search(r"^attention: ", flash, re.M)  # no dropout: the CPU's fused kernel takes it


@pytest.mark.parametrize("flags, message", [
    (["--attention-backend", "fused"], "--attention-backend fused is cuDNN's fused attention and needs CUDA"),
    (["--use-flash-attn", "--attention-backend", "local"], "--use-flash-attn means --attention-backend flash"),
    (["--attention-backend", "sdpa"], "argument --attention-backend: invalid choice"),
])
def test_a_backend_that_cannot_run_is_one_line(flags, message):
    code, stderr = exit_code_and_stderr(TINY + ["--train-iters", "1"] + flags)
    assert code != 0 and message in stderr and len(stderr.strip().splitlines()) == 1, stderr
