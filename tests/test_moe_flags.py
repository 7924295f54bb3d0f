"""The mixture-of-experts flags (mpzero/cli/moe_flags.py, their rules in mpzero/moe/checks.py): Megatron's names and
defaults, --moe-layer-freq's patterns parsed without evaluation, and every bad value or combination one line naming
the flag and what to do, on the command line and in --config."""

import pytest

from mpzero.cli.arguments import parse_args, run_config
from mpzero.errors import ConfigError
from mpzero.moe import parse_moe_layer_freq
from tests.cli import TINY, exit_code_and_stderr, tool_result
from tests.distributed import run_ranks

MOE = ["--num-experts", "4"]
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--no-position-embedding",
         "--disable-bias-linear"]


def test_megatrons_defaults():
    model = run_config(parse_args(TINY + MOE), 1).model
    assert (model.moe_router_topk, model.moe_router_score_function, model.moe_router_load_balancing_type,
            model.moe_aux_loss_coeff, model.moe_z_loss_coeff, model.moe_expert_capacity_factor,
            model.moe_token_dispatcher_type, model.moe_layer_freq, model.expert_ffn_size) == (
        2, "softmax", "aux_loss", 0.0, None, None, "allgather", 1, 4 * 32)
    assert model.moe_router_topk_scaling_factor is None  # Megatron's default: the gates unscaled
    assert run_config(parse_args(TINY + MOE + ["--moe-router-topk-scaling-factor", "2.5"]),
                      1).model.moe_router_topk_scaling_factor == 2.5
    run = run_config(parse_args(TINY + MOE + ["--expert-model-parallel-size", "2"]), 2)
    assert run.parallel.sizes.ep == 2 and run.parallel.sizes.expert_tp == 1


@pytest.mark.parametrize("text,value", [("1", 1), ("2", 2), ("[1,0]*2", (1, 0, 1, 0)), ("([0]+[1]*3)", (0, 1, 1, 1)),
                                        ("[1]*2+[0,1]", (1, 1, 0, 1))])
def test_moe_layer_freq_patterns(text, value):
    assert parse_moe_layer_freq(text) == value


@pytest.mark.parametrize("text", ["__import__('os')", "[1,2]", "[]", "1.5", "[1]*-1+[0]*x"])
def test_moe_layer_freq_is_never_evaluated(text):
    with pytest.raises(ConfigError, match="--moe-layer-freq"):
        parse_moe_layer_freq(text)


@pytest.mark.parametrize("flags,world,message", [
    (["--num-experts", "4", "--moe-router-topk", "5"], 1, "--moe-router-topk 5 must lie between 1 and --num-experts 4"),
    (["--moe-ffn-hidden-size", "16"], 1, "--moe-ffn-hidden-size needs --num-experts"),
    (["--expert-model-parallel-size", "2"], 2, "--expert-model-parallel-size 2 needs --num-experts"),
    (MOE + ["--expert-model-parallel-size", "3", "--global-batch-size", "6"], 3,
     "--num-experts 4 is not a multiple of --expert-model-parallel-size 3"),
    (MOE + ["--expert-model-parallel-size", "4"], 2, "--expert-model-parallel-size 4 does not divide"),
    (MOE + ["--moe-router-topk", "1"], 1, "--moe-router-topk 1 with the softmax score function needs "
                                          "--moe-router-pre-softmax"),
    (MOE + ["--moe-router-enable-expert-bias"], 1, "--moe-router-enable-expert-bias supports the sigmoid score "
                                                   "function only"),
    (MOE + ["--moe-router-num-groups", "2"], 1, "--moe-router-num-groups needs --moe-router-group-topk"),
    (MOE + ["--moe-router-num-groups", "3", "--moe-router-group-topk", "1"], 1, "--num-experts 4 is not divisible "
                                                                                "by --moe-router-num-groups 3"),
    (MOE + ["--moe-router-num-groups", "2", "--moe-router-group-topk", "2", "--moe-router-topk", "3"], 1,
     "--moe-router-topk 3 must be a multiple of --moe-router-group-topk 2"),
    (MOE + ["--moe-layer-freq", "[1,0,1]"], 1, "--moe-layer-freq has 3 entries for --num-layers 2"),
    (MOE + ["--tensor-model-parallel-size", "2"], 2, "sequence parallelism must be used"),
    (MOE + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "2"], 2,
     "biases in the experts (GPT-2's linears; drop them with --disable-bias-linear) need "
     "--expert-tensor-parallel-size 1, not 2"),
    (MOE + LLAMA + ["--tensor-model-parallel-size", "4", "--sequence-parallel", "--expert-tensor-parallel-size", "2"],
     4, "--expert-tensor-parallel-size 2 must be 1 or the TP size 4"),
    (MOE + ["--expert-model-parallel-size", "2", "--fp16"], 2, "Expert parallelism is not supported with fp16"),
    (MOE + ["--context-parallel-size", "2", "--moe-expert-capacity-factor", "1"], 2,
     "--moe-expert-capacity-factor with --context-parallel-size > 1 is not supported yet"),
    (MOE + ["--moe-expert-capacity-factor", "0"], 1, "moe-expert-capacity-factor 0"),
    (MOE + ["--moe-aux-loss-coeff", "-1"], 1, "moe-aux-loss-coeff -1"),
    (MOE + ["--moe-router-topk-scaling-factor", "0"], 1, "moe-router-topk-scaling-factor 0"),
    (["--moe-router-topk-scaling-factor", "2.5"], 1, "--moe-router-topk-scaling-factor needs --num-experts"),
])
def test_each_bad_combination_is_one_line(flags, world, message):
    with pytest.raises(ConfigError) as error:
        run_config(parse_args(TINY + flags), world)
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


@pytest.mark.parametrize("flags,message", [
    (MOE + ["--moe-router-score-function", "relu"], "choose from 'softmax', 'sigmoid'"),
    (MOE + ["--moe-token-dispatcher-type", "flex"], "choose from 'allgather', 'alltoall'"),
    (MOE + ["--moe-layer-freq", "open('x')"], "--moe-layer-freq"),
    (MOE + ["--num-experts", "0"], "num-experts"),
    (MOE + ["--dry-run", "--world-size", "2", "--moe-expert-capacity-factor", "0.5"],
     "--dry-run routes every expert its balanced share"),
])
def test_the_command_line_says_one_line(flags, message):
    code, stderr = run_ranks(1, exit_code_and_stderr, TINY + flags)[0]
    assert code == 2 and stderr.count("\n") == 1 and message in stderr, stderr


@pytest.mark.parametrize("text,message", [
    ("num-experts: 4\nmoe-router-topk: 9\n", "--moe-router-topk 9 must lie between 1 and --num-experts 4"),
    ("num-experts: 4\nmoe-token-drop-policy: random\n", "moe-token-drop-policy"),
    ("num-experts: 4\nmoe-router-topk-scaling-factor: -2.5\n", "moe-router-topk-scaling-factor"),
    ("num-experts: 4\nmoe-layer-freq: \"[1,0]\"\n", None),
])
def test_config_file_values_are_checked_like_the_flags(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    if message is None:  # a pattern from a config file is the flag's
        assert run_config(parse_args(TINY + ["--config", str(path)]), 1).model.moe_layer_freq == (1, 0)
        return
    code, stderr = run_ranks(1, exit_code_and_stderr, TINY + ["--config", str(path)])[0]
    assert code == 2 and stderr.count("\n") == 1 and message in stderr, stderr


def test_experts_with_the_disk_tier_for_parameters_or_gradients_is_one_line(tmp_path):
    """The disk tier keeps one file per rank for the parameters and gradients, and experts are partitioned over
    their own group; the optimizer's states on disk at stage 1 are taken (test_moe_layouts covers cpu offload)."""
    argv = TINY + MOE + ["--zero-stage", "3", "--offload-optimizer", "disk", "--offload-path", str(tmp_path)]
    code, stderr = run_ranks(1, exit_code_and_stderr, argv)[0]
    assert code == 2 and stderr.count("\n") == 1 and "expert parameters are partitioned apart" in stderr, stderr
    assert not list(tmp_path.iterdir())  # nothing left behind


def test_the_planner_says_an_expert_count_the_grid_cannot_split_in_one_line():
    import tools.plan_memory as plan_memory
    argv = ["--world-size", "8", "--device-memory", "80", "--ep-sizes", "3"] + TINY + MOE
    code, stderr = tool_result(plan_memory.main, argv)
    assert code == 2 and stderr.count("\n") == 1 and "no layout to evaluate" in stderr, stderr
