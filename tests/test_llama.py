"""The LLaMA family through the command line: Megatron's flags (on the command line and in --config) reach the
config and its architecture record, bad values are one-line errors, TP 2 x DP 2 (ZeRO 1 and 3, sequence
parallelism, selective recomputation) trains like one process (fp32, 1e-5 relative: the layouts differ only in
the order of floating-point sums), a checkpoint saved at TP 2 (SwiGLU's [gate; up] chunks) reloads at TP 1 with
the same next losses, and a checkpoint of the other family or another head grouping is refused in one line."""

import pytest

from mpzero.cli.arguments import gpt_config, parse_args, run_config
from mpzero.errors import ConfigError
from mpzero.models import GPTConfig
from tests.cli import TINY, assert_close_lists, exit_code_and_stderr, main_capturing_stdout, quiet_main
from tests.distributed import run_ranks

# 4 heads in 2 query groups (one per rank at TP 2), RoPE, RMSNorm, SwiGLU, no biases, untied output.
LLAMA_FLAGS = ["--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu", "--ffn-hidden-size", "48",
               "--position-embedding-type", "rope", "--no-position-embedding", "--group-query-attention",
               "--num-query-groups", "2", "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
LLAMA = TINY + LLAMA_FLAGS


def test_the_flags_reach_the_config_and_its_architecture():
    config = gpt_config(parse_args(LLAMA + ["--rotary-base", "500000", "--rotary-percent", "0.5"]), 300)
    assert (config.normalization, config.layernorm_epsilon, config.swiglu, config.ffn_size) == ("RMSNorm", 1e-6,
                                                                                                  True, 48)
    assert (config.position_embedding_type, config.learned_positions, config.rotary_dim) == ("rope", False, 4)
    assert (config.query_groups, config.add_bias_linear, config.rotary_base) == (2, False, 500000)
    arch = config.architecture()
    assert {k: arch[k] for k in ("normalization", "swiglu", "ffn_hidden_size", "position_embedding_type",
                                 "num_query_groups", "add_bias_linear", "rotary_base", "rotary_percent")} == {
        "normalization": "RMSNorm", "swiglu": True, "ffn_hidden_size": 48, "position_embedding_type": "rope",
        "num_query_groups": 2, "add_bias_linear": False, "rotary_base": 500000, "rotary_percent": 0.5}
    gpt = gpt_config(parse_args(TINY), 300)
    assert (gpt.normalization, gpt.ffn_size, gpt.query_groups, gpt.learned_positions) == ("LayerNorm", 128, 4, True)
    assert gpt.architecture()["rotary_base"] is None  # RoPE's settings mean nothing without RoPE: not compared


def test_megatrons_default_ffn_with_swiglu_and_gqa_default_of_one_group():
    config = gpt_config(parse_args(TINY + ["--hidden-size", "96", "--swiglu", "--group-query-attention"]), 300)
    assert config.ffn_size == int(4 * 96 * 2 / 3 / 64) * 64 == 256 and config.query_groups == 1


def test_the_flags_in_a_config_file(tmp_path):
    path = tmp_path / "llama.yaml"
    path.write_text("normalization: RMSNorm\nswiglu: true\nffn-hidden-size: 48\nposition-embedding-type: rope\n"
                    "group-query-attention: true\nnum-query-groups: 2\ndisable-bias-linear: true\n"
                    "norm-epsilon: 1.0e-6\nno-position-embedding: true\nrotary-base: 500000\n")
    from_file = gpt_config(parse_args(TINY + ["--config", str(path)]), 300)
    from_flags = gpt_config(parse_args(TINY + LLAMA_FLAGS[:-1] + ["--rotary-base", "500000"]), 300)
    assert from_file == from_flags


@pytest.mark.parametrize("extra, tp, message", [
    (["--num-query-groups", "1"], 2, "--num-query-groups 1 is not divisible by --tensor-model-parallel-size 2"),
    (["--num-query-groups", "3"], 1, "--num-attention-heads 4 is not divisible by --num-query-groups 3"),
    (["--ffn-hidden-size", "47"], 2, "--ffn-hidden-size 47 must be positive and divisible by"),
    (["--rotary-percent", "0.1"], 1, "RoPE needs an even number"),
    (["--rotary-percent", "1.5"], 1, "--rotary-percent 1.5 is out of range"),
    (["--normalization", "BatchNorm"], 1, "argument --normalization: invalid choice"),
])
def test_bad_values_are_one_line_errors(extra, tp, message):
    with pytest.raises(ConfigError, match=message) as error:
        run_config(parse_args(LLAMA + ["--tensor-model-parallel-size", str(tp)] + extra), tp)
    assert "\n" not in str(error.value)


def test_num_query_groups_needs_group_query_attention():
    with pytest.raises(ConfigError, match="--num-query-groups 2 needs --group-query-attention"):
        GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=10, max_position_embeddings=8,
                  num_query_groups=2).validate(1)


@pytest.fixture(scope="module")
def reference():
    return run_ranks(1, main_capturing_stdout, LLAMA + ["--zero-stage", "0"])[0][0]


_SP_SEL = ["--sequence-parallel", "--recompute-activations"]


@pytest.mark.parametrize("modes,stage", [  # make test: one of each mode and stage; the other two in the product set
    pytest.param([], 1, id="plain-1"), pytest.param([], 3, id="plain-3", marks=pytest.mark.product),
    pytest.param(_SP_SEL, 1, id="sp-sel-1", marks=pytest.mark.product), pytest.param(_SP_SEL, 3, id="sp-sel-3")])
def test_tp2_dp2_matches_single_process(reference, stage, modes):
    argv = LLAMA + ["--tensor-model-parallel-size", "2", "--zero-stage", str(stage), "--micro-batch-size", "1",
                    "--zero-bucket-numel", "5000"] + modes
    history = run_ranks(4, main_capturing_stdout, argv)[0][0]
    assert_close_lists(history["losses"], reference["losses"])
    assert_close_lists(history["grad_norms"], reference["grad_norms"])
    assert_close_lists(history["valid_losses"], reference["valid_losses"])


@pytest.mark.parametrize("biases", [False, True], ids=["no-bias", "bias"])  # bias: fc1's 1-D [gate; up] chunks too
def test_a_tp2_checkpoint_reloads_at_tp1_with_the_same_next_losses(tmp_path, biases):
    flags = [f for f in LLAMA if not (biases and f == "--disable-bias-linear")]
    argv = flags + ["--train-iters", "6", "--eval-iters", "0"]
    tp2 = ["--tensor-model-parallel-size", "2", "--zero-stage", "3"]
    uninterrupted = run_ranks(4, quiet_main, argv + tp2)[0]
    run_ranks(4, quiet_main, argv + tp2 + ["--save", str(tmp_path), "--exit-interval", "4"])
    resumed = run_ranks(2, quiet_main, argv + ["--zero-stage", "1", "--load", str(tmp_path)])[0]
    assert_close_lists(resumed["losses"], uninterrupted["losses"][4:])


@pytest.mark.parametrize("other, message", [
    (TINY + ["--norm-epsilon", "1e-6", "--untie-embeddings-and-output-weights"],
     "was saved with --normalization RMSNorm, this run has LayerNorm"),
    (TINY + LLAMA_FLAGS[:-6] + LLAMA_FLAGS[-5:] + ["--num-query-groups", "4"],
     "was saved with --num-query-groups 2, this run has 4"),
])
def test_a_checkpoint_of_the_other_family_or_grouping_is_refused(tmp_path, other, message):
    run_ranks(1, quiet_main, LLAMA + ["--save", str(tmp_path), "--train-iters", "1", "--eval-iters", "0"])
    code, stderr = run_ranks(1, exit_code_and_stderr, other + ["--load", str(tmp_path), "--train-iters", "2"])[0]
    assert code == 2 and stderr.count("\n") == 1 and message in stderr, stderr


def _lines(stdout: str, kind: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(kind)]


def test_the_real_run_dry_run_and_planner_agree_for_a_llama_layout():
    """TP 2 x DP 2, ZeRO 3, bf16, SP + selective: the run's activation line says counted = formula (ratio 1),
    and the dry run prints the real run's lines with the planner's figures equal to them."""
    argv = LLAMA + ["--tensor-model-parallel-size", "2", "--zero-stage", "3", "--bf16", "--train-iters", "1",
                    "--sequence-parallel", "--recompute-activations"]
    real = run_ranks(4, main_capturing_stdout, argv)[0][1]
    activation = _lines(real, "activation memory rank 0 ")
    assert activation and activation[0].count("ratio 1.0000") == 2, activation
    _, dry = main_capturing_stdout(argv + ["--dry-run", "--world-size", "4", "--rank", "0"])  # plain python
    assert _lines(dry, "planner |")[0].endswith("| equal")
    for kind in ("zero memory", "zero comm", "activation memory rank 0 "):
        assert _lines(dry, kind) == _lines(real, kind) and _lines(real, kind), kind


def test_the_example_config_is_a_llama_at_tp2_zero3():
    import os
    from tests.cli import ROOT
    args = parse_args(["--config", os.path.join(ROOT, "examples", "llama_tiny.yaml")])
    config = gpt_config(args, 4000)
    assert (args.tensor_model_parallel_size, args.zero_stage) == (2, 3)
    assert (config.normalization, config.swiglu, config.position_embedding_type, config.query_groups,
            config.learned_positions, config.add_bias_linear) == ("RMSNorm", True, "rope", 2, False, False)
    config.validate(2)


@pytest.mark.product  # 13 s of compiling; test_torch_compile compiles layers at TP 2 in make test
def test_compiled_llama_layers_match_eager_at_tp2():
    """--torch-compile with RoPE's autograd function, GQA and SwiGLU inside each compiled layer: the eager losses
    and gradient norms within 1e-5 relative (inductor reorders float sums, tests/test_torch_compile.py)."""
    argv = LLAMA + ["--tensor-model-parallel-size", "2", "--zero-stage", "3", "--train-iters", "3", "--eval-iters", "0"]
    eager = run_ranks(2, main_capturing_stdout, argv, deadline=300)[0][0]
    compiled = run_ranks(2, main_capturing_stdout, argv + ["--torch-compile"], deadline=300)[0][0]
    assert_close_lists(compiled["losses"], eager["losses"], rel=1e-5)
    assert_close_lists(compiled["grad_norms"], eager["grad_norms"], rel=1e-5)
