"""--context-parallel-size and --cp-comm-type: every bad combination is one line naming the flags and what to do,
on the command line and in --config; the dry run of a CP layout equals the planner in every figure (activations,
DP, TP and CP bytes), at Llama-3 8B's shape in the planner; the planner lays out CP only where it can run."""

import pytest

from mpzero.cli.arguments import parse_args, planner_sections, run_config
from mpzero.context_parallel import block_kernel
from mpzero.errors import ConfigError
from mpzero.planner import Machine, Planner
from tests.cli import TINY, exit_code_and_stderr, main_capturing_stdout
from tests.distributed import run_ranks


@pytest.mark.parametrize("flags,world,message", [
    (["--context-parallel-size", "3"], 3, "--seq-length 16 is not divisible by 2 x --context-parallel-size 3 = 6: "
                                          "each CP rank holds two of 2·CP equal chunks"),
    (["--context-parallel-size", "2"], 3, "world size 3 is not divisible by TP 1 x CP 2 x PP 1 = 2"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--tensor-model-parallel-size", "2"], 8,
     "--cp-comm-type a2a splits each TP rank's 2 heads and 2 key/value groups over --context-parallel-size 4: "
     "both must be divisible by it"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--group-query-attention"], 2,  # 1 group
     "--cp-comm-type a2a splits each TP rank's 4 heads and 1 key/value groups over --context-parallel-size 2"),
    (["--context-parallel-size", "2", "--attention-backend", "fused"], 2,
     "--cp-comm-type p2p runs its blocks with the CPU's flash kernel or explicit scores, not cuDNN's fused attention "
     "(--attention-backend fused): use --attention-backend auto, flash or local, or --cp-comm-type a2a"),
    (["--context-parallel-size", "2", "--attention-dropout", "0.1"], 2,
     "the context-parallel attention has no attention dropout: pass --attention-dropout 0"),
    (["--context-parallel-size", "2", "--seq-length", "12", "--tensor-model-parallel-size", "4",
      "--sequence-parallel"], 8, "--sequence-parallel: the 6 tokens of a CP rank (--seq-length 12 / "
                                 "--context-parallel-size 2) are not divisible by --tensor-model-parallel-size 4"),
    (["--context-parallel-size", "2", "--torch-compile"], 2, "with --torch-compile is not supported yet"),
])
def test_each_bad_combination_is_one_line(flags, world, message):
    with pytest.raises(ConfigError) as error:
        run_config(parse_args(TINY + flags), world)
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_the_blocks_kernel_per_backend_and_device():
    assert [block_kernel(asked, "cpu") for asked in ("auto", "flash", "local", "unfused")] == ["flash", "flash",
                                                                                               "local", "local"]
    assert [block_kernel(asked, "cuda") for asked in ("auto", "local", "unfused")] == ["local"] * 3
    with pytest.raises(ConfigError, match=r"^--cp-comm-type p2p and all_gather run their blocks with the CPU's flash "
                                          r"kernel or explicit scores \(local\), not --attention-backend flash on "
                                          r"cuda: use --attention-backend local, or --cp-comm-type a2a"):
        block_kernel("flash", "cuda")
    for flags in (["--cp-comm-type", "a2a", "--attention-backend", "fused"], ["--attention-backend", "flash"], []):
        run = run_config(parse_args(TINY + ["--context-parallel-size", "2"] + flags), 2)
        assert run.model.context_parallel_size == 2 and run.parallel.context_parallel_size == 2


@pytest.mark.parametrize("text,world,message", [
    ("context-parallel-size: 0\n", 1, "context-parallel-size 0 is out of range: it must be >= 1"),
    ("context-parallel-size: 2\ncp-comm-type: ring\n", 2, "cp-comm-type is 'ring': choose one of p2p, all_gather, a2a"),
    ("context-parallel-size: 3\n", 3, "--seq-length 16 is not divisible by 2 x --context-parallel-size 3"),
])
def test_config_file_values_are_checked_like_the_flags(tmp_path, text, world, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    code, stderr = run_ranks(world, exit_code_and_stderr, TINY + ["--config", str(path)])[0]  # rank 0 says it
    assert code == 2 and stderr.count("\n") == 1 and message in stderr, stderr


def test_the_command_line_names_the_comm_types():
    code, stderr = run_ranks(1, exit_code_and_stderr, TINY + ["--cp-comm-type", "allgather"])[0]
    assert code == 2 and stderr.count("\n") == 1 and "choose from 'p2p', 'all_gather', 'a2a'" in stderr, stderr


@pytest.mark.parametrize("comm,extra", [("p2p", []), ("all_gather", ["--recompute-activations"]),
                                        ("a2a", ["--attention-backend", "local"])])
def test_dry_run_of_a_cp_layout_equals_the_planner(comm, extra):
    argv = TINY + ["--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "32", "--micro-batch-size",
                   "1", "--global-batch-size", "4", "--train-iters", "1", "--zero-stage", "3",
                   "--tensor-model-parallel-size", "2", "--context-parallel-size", "2", "--cp-comm-type", comm,
                   "--dry-run", "--world-size", "8", "--rank", "5"] + extra
    _, stdout = main_capturing_stdout(argv)
    planner = [line for line in stdout.splitlines() if line.startswith("planner |")][0]
    assert "CP bytes/iter" in planner and planner.endswith("| equal"), planner


def test_planner_lays_out_cp_where_the_sequence_and_heads_allow():
    args = parse_args(TINY + ["--cp-comm-type", "a2a", "--global-batch-size", "8"])
    planner = Planner(planner_sections(args, 300), Machine(8, 2 ** 30, cuda=False))
    layouts = planner.layouts(stages=(1,), tiers=("none",), recompute=("none",), micro_batches=(1,), cps=(1, 2, 4, 8),
                              pps=(1,))
    shapes = {(lay.tp, lay.cp, lay.dp) for lay in layouts}
    # 16 tokens: 2·CP divides them up to CP 8; TP up to the 4 heads; a2a: the 4 heads over TP x CP ranks
    assert shapes == {(1, 1, 8), (2, 1, 4), (4, 1, 2), (1, 2, 4), (2, 2, 2), (1, 4, 2)}, shapes
    plan = planner.evaluate(next(lay for lay in layouts if (lay.tp, lay.cp) == (2, 2)))
    assert plan.cp_comm > 0 and plan.to_json()["layout"]["cp"] == 2
    assert plan.states.report.line().startswith("zero memory | stage 1 | dp 4 ")  # ZeRO over DP x CP
