"""Megatron-LM's words: --use-distributed-optimizer with Megatron's meaning (ZeRO-1), and a Megatron flag mpzero lacks
answered by one line naming what to use instead (mpzero/cli/megatron_flags.py), on the command line and in
--config."""

import pytest

from mpzero.cli.arguments import build_parser, parse_args
from mpzero.cli.arguments import zero_config
from mpzero.cli.megatron_flags import NOT_IN_MPZERO
from mpzero.errors import ConfigError
from tests.cli import TINY, exit_code_and_stderr
from tools.plan_memory import layout_restrictions, planner_parser


def _options(parser):
    return {option for action in parser._actions for option in action.option_strings}


def test_no_flag_is_both_real_and_in_the_table():
    real = _options(build_parser()) | _options(planner_parser())
    assert not real & set(NOT_IN_MPZERO), "a flag that became real keeps no entry in megatron_flags.py"
    assert all(flag.startswith("--") and line and "\n" not in line for flag, line in NOT_IN_MPZERO.items())


@pytest.mark.parametrize("tokens", [["--pipeline-model-parallel-layout", "Et|tL"],
                                    ["--pipeline-model-parallel-layout=Et|tL"]])
def test_a_megatron_flag_mpzero_lacks_is_one_line_naming_what_to_use(tokens):
    code, err = exit_code_and_stderr(TINY + tokens)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: --pipeline-model-parallel-layout: a Megatron-LM flag that mpzero does not have; "
                          "an explicit stage layout string is not supported: mpzero splits the layers evenly")


def test_an_old_megatron_name_points_at_the_new_one():
    code, err = exit_code_and_stderr(TINY + ["--batch-size", "4"])
    assert code == 2 and "use --micro-batch-size" in err and err.count("\n") == 1, err


def test_an_unknown_flag_outside_the_table_names_the_nearest_flag():
    code, err = exit_code_and_stderr(TINY + ["--hiden-size", "64"])
    assert code == 2 and err == "error: unrecognized arguments: --hiden-size 64; did you mean --hidden-size? " \
                                "(see --help)\n", err


def test_a_megatron_key_in_a_config_file_gets_the_same_line(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("num-layers: 2\nhierarchical-context-parallel-sizes: 2\n")
    code, err = exit_code_and_stderr(TINY + ["--config", str(config)])
    assert code == 2 and f"--config {config}: hierarchical-context-parallel-sizes: a Megatron-LM flag that mpzero " \
                         "does not have; hierarchical context parallelism (a2a+p2p) is not in mpzero" in err, err


@pytest.mark.parametrize("stage, expected", [(None, 1), ("1", 1), ("2", 2), ("3", 3)])
def test_use_distributed_optimizer_is_zero_1_and_agrees_with_the_stages_that_shard_optimizer_states(stage, expected):
    argv = TINY + ["--use-distributed-optimizer"] + (["--zero-stage", stage] if stage else [])
    assert zero_config(parse_args(argv)).stage == expected


def test_use_distributed_optimizer_with_zero_stage_0_is_one_line():
    with pytest.raises(ConfigError, match=r"^--use-distributed-optimizer shards the optimizer states over data "
                                          r"parallelism \(ZeRO-1\), but --zero-stage 0 replicates them"):
        zero_config(parse_args(TINY + ["--use-distributed-optimizer", "--zero-stage", "0"]))
    code, err = exit_code_and_stderr(TINY + ["--use-distributed-optimizer", "--zero-stage", "0"])
    assert code == 2 and err.count("\n") == 1, err


def test_the_planner_reads_use_distributed_optimizer_as_zero_1_unless_a_stage_is_given():
    args = parse_args(TINY + ["--use-distributed-optimizer"])
    fixed, note = layout_restrictions(args, {"use_distributed_optimizer"})
    assert fixed == {"stage": 1} and "--use-distributed-optimizer (ZeRO-1)" in note
    args = parse_args(TINY + ["--use-distributed-optimizer", "--zero-stage", "3"])
    assert layout_restrictions(args, {"use_distributed_optimizer", "zero_stage"})[0] == {"stage": 3}
