"""The activation formula's mixture-of-experts terms (mpzero/activations/moe.py) against the bytes counted with
saved-tensor hooks, through the command line: each MoE layer's formula at the rows the step's routing counted into
the rank's experts equals the counted bytes (ratio 1.0000), for both dispatchers at EP 1 and 2, top-1 and top-2,
shared experts, TP 2 x SP x EP 2 (expert-TP 1 and 2), selective and full recomputation, GPT-2 and LLaMA hosts; the
dropless worst case the line also prints bounds the counted bytes. The product cases add bf16, the fp64 router,
sigmoid scores with the expert bias, group-limited routing, seq_aux_loss, the grouped GEMM, capacity drops (the
worst case then bounded by the capacity), PP and b = 1."""

import dataclasses
import re

import pytest
import torch

from mpzero.activations import activation_formula, modeled, moe_shape
from mpzero.models import GPTConfig
from tests.cli import main_capturing_stdout
from tests.distributed import run_ranks

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1", "--lr", "1e-3",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data", "--vocab-size", "128",
        "--log-interval", "1", "--eval-iters", "0", "--num-experts", "4", "--moe-ffn-hidden-size", "16",
        "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", "--moe-token-dispatcher-type", "alltoall"]
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--no-position-embedding",
         "--disable-bias-linear", "--group-query-attention", "--num-query-groups", "2"]
ALLGATHER = ["--moe-token-dispatcher-type", "allgather"]
TOP1_SHARED = ["--moe-router-topk", "1", "--moe-router-pre-softmax", "--moe-shared-expert-intermediate-size", "32"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
SELECTIVE = ["--recompute-activations"]
SIGMOID_BIAS_GROUPS = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                       "--moe-router-num-groups", "2", "--moe-router-group-topk", "1"]
SEQ_AUX = ["--moe-router-load-balancing-type", "seq_aux_loss"]
GROUPED = ["--moe-grouped-gemm"]
CAPACITY = ["--moe-expert-capacity-factor", "1.0"]
SCALED = ["--moe-router-topk-scaling-factor", "2.5"]  # the gates x 2.5: the weighting keeps a scaled copy
FULL_BLOCK = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"]


def ep(size):
    return ["--expert-model-parallel-size", str(size)]


def _activation_lines(world: int, argv: list[str]) -> list[str]:
    outputs = run_ranks(world, main_capturing_stdout, BASE + argv)
    lines = [line for _, out in outputs for line in out.splitlines() if line.startswith("activation memory rank")]
    assert len(lines) == world, lines
    return lines


def _assert_exact(lines: list[str], moe_layers_per_rank: int) -> None:
    """Every ratio 1.0000; each MoE layer's counted R and worst case printed, the worst case >= the counted bytes."""
    for line in lines:
        assert "no formula" not in line, line
        ratios = re.findall(r"ratio (\d+\.\d+)", line)
        assert ratios and set(ratios) == {"1.0000"}, line
        moe = re.findall(r"(\d[\d,]*) B counted, formula ([\d,]+) B = [^|]*?\(mixture of experts at R ([\d,]+) "
                         r"rows counted into this rank's experts; (?:dropless worst case|worst case at capacity) "
                         r"R ([\d,]+): ([\d,]+) B\)", line)
        assert len(moe) == moe_layers_per_rank, line
        for counted, formula, rows, worst_rows, worst in ((int(v.replace(",", "")) for v in m) for m in moe):
            assert counted == formula and rows <= worst_rows and worst >= counted
            if rows < worst_rows:
                assert worst > counted


@pytest.mark.parametrize("world,argv,moe_layers", [
    (1, [], 2),
    (2, ep(2), 2),
    (2, ep(2) + ALLGATHER + SELECTIVE, 2),
    (4, LLAMA + TOP1_SHARED + TP2_SP + ep(2), 2),
    (2, ep(2) + FULL_BLOCK, 1),
    (2, ep(2) + SIGMOID_BIAS_GROUPS + GROUPED, 2),
    (2, ep(2) + CAPACITY, 2),
    (2, ep(2) + SCALED, 2),
], ids=["ep1", "ep2-alltoall", "ep2-allgather-selective", "llama-top1-shared-tp2-sp-ep2", "ep2-full-block",
        "ep2-sigmoid-bias-groups-grouped-gemm", "ep2-capacity", "ep2-topk-scaling"])
def test_moe_layers_count_equals_formula(world, argv, moe_layers):
    _assert_exact(_activation_lines(world, argv), moe_layers)


@pytest.mark.product
@pytest.mark.parametrize("world,argv,moe_layers", [
    (1, LLAMA + ALLGATHER, 2),
    (1, ["--bf16"] + TOP1_SHARED, 2),
    (2, ep(2) + ["--moe-router-dtype", "fp64"] + TOP1_SHARED, 2),
    (2, LLAMA + ep(2) + SELECTIVE + ["--moe-shared-expert-intermediate-size", "32"], 2),
    (2, ep(2) + ALLGATHER + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                             "--recompute-num-layers", "1"], 0),
    (4, TP2_SP + ep(2) + ["--expert-tensor-parallel-size", "1"], 2),
    (4, LLAMA + TP2_SP + ep(2) + ALLGATHER + TOP1_SHARED, 2),
    (4, ["--bf16"] + TP2_SP + ep(2) + ["--expert-tensor-parallel-size", "1"] + SELECTIVE, 2),
    (4, ep(2) + ["--pipeline-model-parallel-size", "2"], 1),
    (1, ["--micro-batch-size", "1", "--moe-shared-expert-intermediate-size", "32"], 2),
    (2, ep(2) + SIGMOID_BIAS_GROUPS + ALLGATHER, 2),
    (1, ["--moe-router-num-groups", "2", "--moe-router-group-topk", "1"] + SEQ_AUX + GROUPED, 2),
    (4, LLAMA + TP2_SP + ep(2) + ["--moe-router-score-function", "sigmoid"] + SEQ_AUX + GROUPED, 2),
    (2, ep(2) + ["--moe-router-score-function", "sigmoid", "--moe-router-topk", "1"], 2),
    (2, ep(2) + CAPACITY + ALLGATHER + ["--moe-token-drop-policy", "position"], 2),
    (4, LLAMA + TP2_SP + ep(2) + CAPACITY + ["--moe-router-pre-softmax"], 2),
    (4, TP2_SP + ep(2) + ["--expert-tensor-parallel-size", "1", "--moe-router-score-function", "sigmoid",
                          "--moe-expert-capacity-factor", "0.5"], 2),
    (2, ep(2) + ALLGATHER + SCALED + ["--moe-router-score-function", "sigmoid"], 2),
    (1, SCALED + ["--moe-router-topk", "1", "--moe-router-pre-softmax"], 2),
], ids=["llama-allgather-ep1", "bf16-top1-shared", "fp64-router-ep2", "llama-shared-selective-ep2",
        "allgather-full-uniform", "tp2-sp-ep2-etp1", "llama-tp2-sp-ep2-allgather-top1-shared",
        "bf16-tp2-sp-etp1-selective", "pp2-ep2", "b1-shared", "sigmoid-bias-groups-allgather-ep2",
        "groups-seq-aux-grouped-gemm", "llama-tp2-sp-ep2-sigmoid-seq-aux-grouped", "sigmoid-top1-ep2",
        "capacity-position-allgather-ep2", "llama-tp2-sp-ep2-capacity-pre-softmax", "tp2-sp-etp1-capacity-sigmoid",
        "scaling-allgather-sigmoid-ep2", "scaling-pre-softmax-top1"])
def test_moe_layouts_count_equals_formula(world, argv, moe_layers):
    _assert_exact(_activation_lines(world, argv), moe_layers)


CONFIG = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, max_position_embeddings=16,
                   seq_length=16, num_experts=4, moe_ffn_hidden_size=16, moe_aux_loss_coeff=1e-2,
                   moe_z_loss_coeff=1e-3, moe_token_dispatcher_type="alltoall", hidden_dropout=0.0,
                   attention_dropout=0.0)


def _setting(config, ep=1, etp=1):
    setting = config.activation_setting(1, 2, 16, dtype=torch.float32)
    return dataclasses.replace(setting, moe=moe_shape(config, ep, etp))


def test_worst_case_is_every_slot_to_this_rank_and_bounds_any_rows():
    setting = _setting(CONFIG, ep=2)
    worst = activation_formula(setting)  # no counted rows: every MoE layer at its dropless worst case
    assert [layer.rows for layer in worst.layers] == [2 * 32 * 2] * 2  # EP x tokens x min(k, local experts)
    assert worst.micro_batch_bytes == worst.worst_case_bytes
    for rows in (0, 1, 64, 127):
        formula = activation_formula(setting, {0: (rows, 64), 1: (rows, 64)})
        assert formula.worst_case_bytes == worst.micro_batch_bytes
        assert formula.micro_batch_bytes < worst.micro_batch_bytes
    one_local = _setting(dataclasses.replace(CONFIG, num_experts=2), ep=2)
    assert activation_formula(one_local).layers[0].rows == 2 * 32 * 1  # one local expert: one slot per token


def test_capacity_bounds_the_worst_case():
    """With capacity drops each source rank sends an expert at most ceil(s b k / E x factor) rows."""
    capped = _setting(dataclasses.replace(CONFIG, moe_expert_capacity_factor=0.5), ep=2)
    assert modeled(capped) is None and modeled(_setting(CONFIG)) is None
    assert activation_formula(capped).layers[0].rows == 2 * 2 * 8  # EP x local experts x ceil(32 x 2 / 4 x 0.5)
    loose = _setting(dataclasses.replace(CONFIG, moe_expert_capacity_factor=4.0), ep=2)
    assert activation_formula(loose).layers[0].rows == 2 * 32 * 2  # the dropless bound is the smaller
