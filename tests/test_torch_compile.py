"""--torch-compile (each TransformerLayer's forward through torch.compile, inductor's C++ backend on this CPU)
against the eager run through the CLI: the same losses and gradient norms within 1e-5 relative in fp32 (inductor
fuses elementwise chains and reorders reductions: float rounding, never a different computation), at TP 1 with
ZeRO-1, and at TP 2 with ZeRO-3 (its gather/release hooks around the compiled forward), sequence parallelism
and selective recomputation; bf16 within 2e-2 (one bf16 rounding of a fused chain differs from the eager op-by-op
roundings). Dropout is 0: compiled dropout draws its masks from inductor's generator. Compilation costs seconds
per rank: the models are tiny and the runs share the run's one inductor cache and compile in their own process
(tests/conftest.py)."""

from tests.cli import TINY, assert_close_lists, main_capturing_stdout
from tests.distributed import run_ranks

ITERS = ["--train-iters", "3", "--eval-iters", "0"]  # no evaluation: no no-grad graphs to compile


def _history(argv):
    history, stdout = main_capturing_stdout(argv)
    return history, stdout


def _losses_and_norms(world, flags):
    eager = run_ranks(world, _history, TINY + ITERS + flags, deadline=300)[0][0]
    compiled, stdout = run_ranks(world, _history, TINY + ITERS + flags + ["--torch-compile"], deadline=300)[0]
    return eager, compiled, stdout


def test_compiled_layers_match_eager_at_tp1_zero1():
    eager, compiled, _ = _losses_and_norms(1, ["--zero-stage", "1"])
    assert_close_lists(compiled["losses"], eager["losses"], rel=1e-5)
    assert_close_lists(compiled["grad_norms"], eager["grad_norms"], rel=1e-5)


def test_compiled_layers_match_eager_at_tp2_zero3_sp_selective():
    flags = ["--tensor-model-parallel-size", "2", "--zero-stage", "3", "--sequence-parallel",
             "--recompute-activations"]
    eager, compiled, _ = _losses_and_norms(2, flags)
    assert_close_lists(compiled["losses"], eager["losses"], rel=1e-5)
    assert_close_lists(compiled["grad_norms"], eager["grad_norms"], rel=1e-5)


def test_compiled_layers_match_eager_in_bf16():
    eager, compiled, _ = _losses_and_norms(1, ["--bf16"])
    assert_close_lists(compiled["losses"], eager["losses"], rel=2e-2)
