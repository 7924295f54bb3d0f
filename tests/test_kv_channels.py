"""--kv-channels (Megatron's projection size per attention head; Qwen3's head_dim): a LLaMA of hidden 32 with 4
heads of 12 (48 != 32) in 2 key/value groups.
  - the flag (and its --config key) reaches the config and its architecture record; each bad value is one line;
    a hidden size that heads do not divide is a model once the head size is given;
  - through the CLI it trains like one process (fp32, 1e-5 relative) at TP 2 with SP x DP 2 under ZeRO 3, CP 2
    (p2p, a2a) and PP 2 (fast), and at TP 2, CP 2 all_gather, TP 2 x CP 2, PP 2 with zero bubble, DP 2 under
    ZeRO 1, 2 and 3, and with --qk-layernorm at TP 2 (product); GPT-2's attention and half the head rotated
    (--rotary-percent 0.5) at TP 2 + SP (fast) too, and a Qwen3-MoE-shaped model (q/k norms, experts) at CP 2,
    EP 2 and TP 2 + SP x EP 2 (product);
  - FLOPs per token equal FlopCounterMode's count of the matmuls, with selective recomputation;
  - the run's activation line, zero memory and comm lines equal their formulas (ratio 1.0000), and the dry run
    prints the real run's lines with the planner's figures (TP bytes included) equal to them;
  - a checkpoint of another head size is one line, and so is its export to GPT2LMHeadModel (no head_dim there);
  - the published Qwen3-30B-A3B config.json (head_dim 128 != 2048 / 32) is a model with HF's 30.5B parameters.
The Hugging Face and Megatron-LM imports and exports with a head size of their own: test_hf_llama.py,
test_hf_moe.py (Qwen3-MoE), test_import_megatron.py."""

import dataclasses
import math
import os
import re
import runpy

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from mpzero.cli.arguments import gpt_config, parse_args, run_config
from mpzero.errors import ConfigError
from mpzero.inference.hf_qwen3_moe import config_from_hf
from mpzero.inference.weights import expected_shapes
from mpzero.models import GPTConfig
from tests.cli import TINY, assert_close_lists, exit_code_and_stderr, main_capturing_stdout, quiet_main, tool_result
from tests.distributed import run_ranks
from tests.test_flops import NO_DROPOUT, _counted_flops
from tests.test_llama import LLAMA
from tests.test_pipeline import BASE as PIPELINE_BASE
from tests.test_pipeline import LLAMA as PIPELINE_LLAMA
from tests.trained_gpt import TOOLS

KV = LLAMA + ["--kv-channels", "12"]
_REFERENCES: dict = {}


def _reference(argv: tuple) -> dict:
    if argv not in _REFERENCES:
        _REFERENCES[argv] = run_ranks(1, quiet_main, list(argv) + ["--zero-stage", "0"])[0]
    return _REFERENCES[argv]


def _assert_like_one_process(world: int, extra: list, base=tuple(KV)) -> str:
    """The run at `world` ranks with `extra` flags trains like one process; what its ranks printed (rank 0, or
    under a pipeline the last stage, logs)."""
    reference = _reference(base)
    ranks = run_ranks(world, main_capturing_stdout, list(base) + extra, deadline=300)
    for history, _ in ranks:  # a pipeline's every stage sees the loss
        for key in ("losses", "grad_norms", "valid_losses"):
            assert_close_lists(history[key], reference[key])
    return "".join(stdout for _, stdout in ranks)


def _ratios_are_one(stdout: str, kinds=("activation memory", "zero memory", "zero comm", "cp comm")) -> None:
    lines = [line for line in stdout.splitlines() if line.startswith(kinds)]
    assert any(line.startswith("activation memory") for line in lines), stdout[-2000:]
    for line in lines:
        ratios = re.findall(r"ratio ([0-9.]+)", line)
        assert ratios and all(r == "1.0000" for r in ratios), line


def test_the_flag_reaches_the_config_and_its_architecture(tmp_path):
    config = gpt_config(parse_args(KV), 300)
    assert (config.kv_channels, config.head_dim, config.attention_width) == (12, 12, 48)
    assert config.architecture()["kv_channels"] == 12
    assert gpt_config(parse_args(LLAMA), 300).architecture()["kv_channels"] == 8  # hidden / heads: recorded too
    path = tmp_path / "run.yaml"
    path.write_text("kv-channels: 12\n")
    assert gpt_config(parse_args(LLAMA + ["--config", str(path)]), 300) == config
    odd = GPTConfig(num_layers=1, hidden_size=30, num_attention_heads=4, vocab_size=10, max_position_embeddings=8)
    with pytest.raises(ConfigError, match="not divisible by --num-attention-heads 4: .* or give the head size as "
                                          "--kv-channels"):
        odd.validate(1)
    dataclasses.replace(odd, kv_channels=8).validate(1)  # 4 heads of 8 read and write a hidden size of 30


@pytest.mark.parametrize("extra, message", [
    (["--kv-channels", "0"], "--kv-channels 0 is out of range"),
    (["--kv-channels", "-4"], "--kv-channels -4 is out of range"),
    (["--kv-channels", "10", "--rotary-percent", "0.5"], "--rotary-percent 0.5 of head size 10 rotates 5 features"),
    (["--kv-channels", "1"], "of head size 1 rotates 1 features: RoPE needs an even number"),
])
def test_bad_values_are_one_line(extra, message):
    with pytest.raises(ConfigError, match=message) as error:
        run_config(parse_args(LLAMA + extra), 1)
    assert "\n" not in str(error.value)


def test_a_bad_value_in_a_config_file_is_one_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("kv-channels: 0\n")
    code, stderr = exit_code_and_stderr(LLAMA + ["--config", str(path)])
    assert code == 2 and stderr.count("\n") == 1 and "run.yaml: kv-channels 0 is out of range" in stderr, stderr


@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "selective"])
def test_flops_per_token_equal_the_counted_matmuls(recompute):
    """QKV 2h(a + 2g)d, the projection 2adh, the core attention 4sad (and its selective replay): FlopCounterMode
    counts the same (the explicit attention: torch's counter has no entry for the CPU flash kernel)."""
    config = dataclasses.replace(NO_DROPOUT, seq_length=12, max_position_embeddings=12, attention_backend="local",
                                 kv_channels=12, group_query_attention=True, num_query_groups=2,
                                 recompute_activations=recompute, cross_entropy_chunk_size=0)
    counted = run_ranks(1, _counted_flops, config, 3, 12)[0]
    assert counted == config.flops_per_token(micro_batch_size=3) * 3 * 12
    assert config.flops_per_token() != dataclasses.replace(config, kv_channels=None).flops_per_token()


def test_tp2_sp_dp2_zero3_trains_like_one_process_and_counts_its_formulas():
    stdout = _assert_like_one_process(4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                          "--zero-stage", "3", "--zero-bucket-numel", "5000"])
    _ratios_are_one(stdout)


def _lines(stdout: str, kind: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(kind)]


@pytest.mark.parametrize("extra", [["--sequence-parallel", "--recompute-activations", "--bf16"],
                                   ["--qk-layernorm", "--attention-backend", "local"]], ids=["sp-selective-bf16",
                                                                                            "qk-norm-local"])
def test_the_dry_run_prints_the_real_runs_lines_and_the_planner_agrees(extra):
    """TP 2 x DP 2, ZeRO 3: the real run's activation line is its formula (ratio 1), and the dry run prints the
    real run's zero memory, zero comm and activation lines, its planner row `equal` with the same TP bytes."""
    argv = KV + ["--tensor-model-parallel-size", "2", "--zero-stage", "3", "--train-iters", "1"] + extra
    real = run_ranks(4, main_capturing_stdout, argv)[0][1]
    _ratios_are_one(real)
    _, dry = main_capturing_stdout(argv + ["--dry-run", "--world-size", "4", "--rank", "0"])
    planner = _lines(dry, "planner |")[0]
    assert planner.endswith("| equal"), planner
    tp_bytes = next(part for part in planner.split(" | ") if part.startswith("TP bytes/iter")).split()
    assert tp_bytes[2] == tp_bytes[4], planner
    for kind in ("zero memory", "zero comm", "activation memory rank 0 "):
        assert _lines(dry, kind) == _lines(real, kind) and _lines(real, kind), kind


def test_a_checkpoint_of_another_head_size_is_refused(tmp_path):
    run_ranks(1, quiet_main, KV + ["--save", str(tmp_path), "--train-iters", "1", "--eval-iters", "0"])
    code, stderr = run_ranks(1, exit_code_and_stderr, LLAMA + ["--load", str(tmp_path), "--train-iters", "2"])[0]
    assert code == 2 and stderr.count("\n") == 1 and "was saved with --kv-channels 12, this run has 8" in stderr


FAST = {"cp2-p2p": (2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
        "cp2-a2a": (2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"])}
PRODUCT = {"tp2": (2, ["--tensor-model-parallel-size", "2"]), "zero1": (2, ["--zero-stage", "1"]),
           "zero2": (2, ["--zero-stage", "2"]), "zero3": (2, ["--zero-stage", "3"]),
           "cp2-all-gather-local": (2, ["--context-parallel-size", "2", "--cp-comm-type", "all_gather",
                                        "--attention-backend", "local"]),
           "tp2-sp-cp2": (4, ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
                              "--sequence-parallel"]),
           "qk-norm-tp2-sp": (2, ["--qk-layernorm", "--tensor-model-parallel-size", "2", "--sequence-parallel"])}


@pytest.mark.parametrize("world, extra", [pytest.param(*case, id=name) for name, case in FAST.items()] + [
    pytest.param(*case, id=name, marks=pytest.mark.product) for name, case in PRODUCT.items()])
def test_layouts_train_like_one_process(world, extra):
    qk = [f for f in extra if f == "--qk-layernorm"]
    stdout = _assert_like_one_process(world, [f for f in extra if f not in qk], base=tuple(KV + qk))
    _ratios_are_one(stdout)


QWEN3_MOE = KV + ["--qk-layernorm", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24"]


@pytest.mark.product
@pytest.mark.parametrize("world, extra", [
    (2, ["--context-parallel-size", "2"]), (2, ["--expert-model-parallel-size", "2"]),
    (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2"])],
    ids=["cp2", "ep2", "tp2-sp-ep2"])
def test_a_qwen3_moe_shaped_model_trains_like_one_process(world, extra):
    """Qwen3-MoE's shape: q/k norms, experts and a head size of its own, at CP 2, EP 2 and TP 2 + SP x EP 2."""
    _ratios_are_one(_assert_like_one_process(world, extra, base=tuple(QWEN3_MOE)))


@pytest.mark.parametrize("base", [pytest.param(TINY + ["--kv-channels", "12"], marks=pytest.mark.product),
                                  KV + ["--rotary-percent", "0.5"]],
                         ids=["gpt2", "llama-rotary-half"])
def test_other_hosts_at_tp2_sp_train_like_one_process(base):
    """GPT-2's attention (learned positions, biases, MHA) and partial RoPE (6 of each head's 12 features, joined
    back in the whole rotation's memory order: the projection reads attention's output as a view, as the
    formula has it)."""
    _ratios_are_one(_assert_like_one_process(2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                                             base=tuple(base)))


@pytest.mark.parametrize("flags", [[], pytest.param(["--enable-zero-bubble"], marks=pytest.mark.product)],
                         ids=["pp2", "pp2-zb-h1"])
def test_pipeline_stages_train_like_one_process(flags):
    base = tuple(PIPELINE_BASE + PIPELINE_LLAMA + ["--kv-channels", "12"])
    stdout = _assert_like_one_process(2, ["--pipeline-model-parallel-size", "2", "--log-interval", "1"] + flags,
                                      base=base)
    _ratios_are_one(stdout, ("activation memory", "pipeline comm"))  # zb-h1: the weight-gradient store's terms


def test_a_gpt2_with_its_own_head_size_is_refused_by_export(tmp_path):
    export_main = runpy.run_path(os.path.join(TOOLS, "export_hf.py"))["main"]
    run_ranks(1, quiet_main, TINY + ["--kv-channels", "12", "--train-iters", "1", "--eval-iters", "0",
                                     "--save", str(tmp_path / "ckpt")])
    code, err = tool_result(export_main, ["--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf")])
    assert code == 2 and err.count("\n") == 1 and "--kv-channels 12 (GPT-2's heads split n_embd)" in err, err
    assert not (tmp_path / "hf").exists()


def test_the_published_qwen3_30b_a3b_config_is_hfs_model():
    """Qwen3-30B-A3B's config.json (hidden 2048, 32 heads of 128, 4 key/value heads, 128 experts, top 8): mpzero's
    model of it has HF's parameters, every one (both built on the meta device: nothing allocated)."""
    hf = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
              num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
              moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
              rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    config = config_from_hf({**hf, "model_type": "qwen3_moe"}, "Qwen3-30B-A3B")
    assert (config.kv_channels, config.attention_width, config.query_groups) == (128, 4096, 4)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf)).parameters())
    assert sum(math.prod(shape) for shape in expected_shapes(config).values()) == theirs == 30_532_122_624
