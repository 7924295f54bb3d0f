"""--fp8-param-gather (mpzero/zero/fp8_gather.py): ZeRO-3 gathers the tensorwise FP8 linears' weights in float8,
each rank casting its pieces with the whole weight's scale, so the run is bitwise the bf16-gathered one: losses,
gradient norms and the saved parameters and optimizer states (compared by the checkpoints' chunk checksums) at
DP 2 and at TP 2 x DP 2. The `zero comm` line counts the gathers' bytes against its formula (1 byte per float8
element, the payloads' padding, the amax all-reduces): ratio 1.0000, and the FP8 weights' gather costs about half
of the bf16 one. A checkpoint of a flagged run resumes bit for bit (`product`); the flag's bad combinations are
one line each."""

import pytest

from mpzero.checkpointing.checksums import read_checksums
from mpzero.zero.accounting import comm_theory
from tests.cli import TINY, exit_code_and_stderr, main_capturing_stdout, quiet_main
from tests.distributed import run_ranks

SMALL = TINY + ["--hidden-size", "64", "--seq-length", "32", "--eval-iters", "0", "--bf16", "--log-interval", "4",
                "--train-iters", "4", "--fp8-format", "hybrid", "--zero-stage", "3"]
FLAG = ["--fp8-param-gather"]


def _comm(stdout: str) -> dict:
    line = next(line for line in stdout.splitlines() if line.startswith("zero comm"))
    return dict(field.strip().rsplit(" ", 1) for field in line.split("|")[1:])


def _checksums(directory) -> dict:
    return read_checksums(str(directory / "iter_0000004"), 2, "")[1]


def _run_both(world: int, extra: list[str], tmp_path) -> tuple:
    runs = []
    for name, flags in (("bf16", []), ("fp8", FLAG)):
        save = ["--save", str(tmp_path / name)] if tmp_path is not None else []
        runs.append(run_ranks(world, main_capturing_stdout, SMALL + extra + flags + save, deadline=300)[0])
    return runs


def test_dp2_gathers_fp8_weights_bitwise_at_about_half_their_bytes(tmp_path):
    (plain, plain_out), (fp8, fp8_out) = _run_both(2, [], tmp_path)
    assert fp8["losses"] == plain["losses"] and fp8["grad_norms"] == plain["grad_norms"]
    chunks = _checksums(tmp_path / "fp8")
    assert len(chunks) > 10 and chunks == _checksums(tmp_path / "bf16")  # parameters and optimizer states
    counted, unflagged = _comm(fp8_out), _comm(plain_out)
    assert counted["ratio"] == "1.0000" and unflagged["ratio"] == "1.0000"
    assert counted["theory"] == "(16P-2E+2Z+16A)(N-1)/N"
    # what the FP8 weights' gathers cost: 2 bytes each in bf16, here E + Z + 4A (from the two lines' difference)
    saved = float(unflagged["measured bytes/iter"]) - float(counted["measured bytes/iter"])
    gathers = 2 * 2 * (2 - 1) / 2  # 2 per micro-batch, m = 2, ring (N-1)/N: saved = gathers x (2E - (E + Z + 4A))
    eight = _fp8_elements(2)
    fp8_bytes = 2 * eight - saved / gathers
    assert 0.5 * 2 * eight <= fp8_bytes <= 0.55 * 2 * eight, (fp8_bytes, eight)


def _fp8_elements(layers: int) -> int:
    """E: the FP8 weights of TINY at hidden 64 (QKV 192 x 64, output 64 x 64, fc1 256 x 64, fc2 64 x 256)."""
    return layers * (192 * 64 + 64 * 64 + 256 * 64 + 64 * 256)


def test_tp2_dp2_gathers_fp8_weights_bitwise():
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--train-iters", "2", "--log-interval", "2"]
    (plain, _), (fp8, fp8_out) = _run_both(4, layout, None)
    assert fp8["losses"] == plain["losses"] and fp8["grad_norms"] == plain["grad_norms"]
    assert _comm(fp8_out)["ratio"] == "1.0000"


@pytest.mark.product
@pytest.mark.parametrize("extra", [
    ["--zero-units", "linear", "--recompute-granularity", "full", "--recompute-method", "uniform",
     "--recompute-num-layers", "1"],  # a third gather of each linear unit, in float8 too
    ["--torch-compile"]], ids=["linear-units-recomputed", "compiled"])
def test_other_stage3_settings_gather_fp8_weights_bitwise(extra):
    (plain, _), (fp8, fp8_out) = _run_both(2, extra, None)
    assert fp8["losses"] == plain["losses"] and fp8["grad_norms"] == plain["grad_norms"]
    assert _comm(fp8_out)["ratio"] == "1.0000"


def test_comm_theory_counts_float8_elements_padding_and_amaxes():
    m, n, p, g, numel = 2, 2, 2, 4, 1000
    bf16, _ = comm_theory(3, n, numel, p, g, m)
    fp8, text = comm_theory(3, n, numel, p, g, m, fp8_gather=(1200, 20, 4))  # two gathers of 600 elements
    assert text == "(16P-2E+2Z+16A)(N-1)/N"
    assert fp8 == bf16 - (2 * m * (600 - 10) - m * 8 * 4) * (n - 1) / n


@pytest.mark.product
def test_a_flagged_run_resumes_bit_for_bit(tmp_path):
    argv = SMALL + FLAG + ["--train-iters", "6"]
    whole = run_ranks(2, quiet_main, argv)[0]["losses"]
    run_ranks(2, quiet_main, argv + ["--save", str(tmp_path), "--exit-interval", "3"])
    resumed = run_ranks(2, quiet_main, argv + ["--load", str(tmp_path)])[0]["losses"]
    unflagged = run_ranks(2, quiet_main, SMALL + ["--train-iters", "6", "--load", str(tmp_path)])[0]["losses"]
    assert resumed == whole[3:] == unflagged  # the checkpoint holds the bf16-gathered run's weights


@pytest.mark.parametrize("flags,message", [
    (["--zero-stage", "3"], "--fp8-param-gather gathers the FP8 linears' weights in float8, but --fp8-format is "
                            "not given"),
    (["--zero-stage", "3", "--fp8-format", "e4m3", "--fp8-recipe", "rowwise"], "needs --fp8-recipe tensorwise"),
    (["--zero-stage", "2", "--fp8-format", "hybrid"], "--fp8-param-gather with --zero-stage 2: Megatron's flag"),
    (["--zero-stage", "3", "--fp8-format", "hybrid", "--offload-params", "cpu",
      "--offload-optimizer", "cpu"],
     "--fp8-param-gather with --offload-params cpu"),
    (["--zero-stage", "3", "--fp8-format", "hybrid", "--num-experts", "4"], "--fp8-param-gather with --num-experts")])
def test_bad_combinations_are_one_line(flags, message):
    code, stderr = exit_code_and_stderr(TINY + ["--bf16"] + flags + FLAG)
    assert code != 0 and message in stderr and len(stderr.strip().splitlines()) == 1, stderr
