"""Mixture of experts through the command line (pretrain_gpt.main on forked gloo ranks), dropout off, fp32: every
expert-parallel layout trains the losses, validation losses and gradient norms of one process within 1e-5
relative (the bar of every TP x DP x ZeRO layout: the experts' gradients are summed over the EP ranks' tokens in
another order), with the load-balancing loss and the z-loss on; the figures the log prints (the auxiliary losses,
the tokens per expert, the EP bytes against their formula) are the same at every layout. The slow compositions
are product tests; the normal suite keeps one of each axis (EP over DP, TP x EP, PP x EP (the auxiliary losses
reach the loss from any stage), ZeRO 3 with experts, the allgather dispatcher, capacity drops, LLaMA with shared
experts and sigmoid routing)."""

import re

import pytest

from tests.cli import assert_close_lists, main_capturing_stdout, quiet_main
from tests.distributed import run_ranks

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-3",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data", "--vocab-size", "128",
        "--log-interval", "100", "--eval-iters", "1", "--eval-interval", "2",
        "--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-aux-loss-coeff", "1e-2",
        "--moe-z-loss-coeff", "1e-3", "--moe-token-dispatcher-type", "alltoall"]
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--no-position-embedding",
         "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]
SCALED = ["--moe-router-topk-scaling-factor", "2.5"]  # DeepSeek-V3's routed_scaling_factor
SHARED_SIGMOID = ["--moe-shared-expert-intermediate-size", "32", "--moe-router-score-function", "sigmoid"]


def ep(size, *more):
    return ["--expert-model-parallel-size", str(size), *more]


_REFERENCES = {}


def _reference(argv: list[str]) -> dict:
    key = tuple(argv)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_ranks(1, quiet_main, argv)[0]
    return _REFERENCES[key]


def _assert_matches_one_process(world: int, model: list[str], layout: list[str]) -> None:
    reference = _reference(BASE + model)
    for history in run_ranks(world, quiet_main, BASE + model + layout):
        assert_close_lists(history["losses"], reference["losses"])
        assert_close_lists(history["valid_losses"], reference["valid_losses"])
        assert_close_lists(history["grad_norms"], reference["grad_norms"])


@pytest.mark.parametrize("world,model,layout", [
    (2, [], ep(2)),
    (4, LLAMA + SHARED_SIGMOID, ep(4, "--zero-stage", "3")),
    (4, LLAMA, ep(2, "--tensor-model-parallel-size", "2", "--sequence-parallel")),
    (2, [], ep(2, "--moe-token-dispatcher-type", "allgather", "--zero-stage", "1")),
    (2, ["--moe-expert-capacity-factor", "1.0"], ep(2, "--zero-stage", "2")),
    (4, [], ep(2, "--pipeline-model-parallel-size", "2")),
    (2, SCALED, ep(2)),
], ids=["ep2", "llama-shared-sigmoid-ep4-zero3", "tp2-ep2-sp", "allgather-zero1", "capacity-zero2", "pp2-ep2",
        "topk-scaling-ep2"])
def test_expert_parallel_layouts_match_one_process(world, model, layout):
    _assert_matches_one_process(world, model, layout)


@pytest.mark.product
@pytest.mark.parametrize("world,model,layout", [
    (4, [], ep(2, "--zero-stage", "0")),
    (4, [], ep(2, "--zero-stage", "1")),
    (4, [], ep(2, "--zero-stage", "2")),
    (4, [], ep(2, "--zero-stage", "3")),
    (4, [], ep(4)),
    (4, [], ep(2, "--zero-stage", "1", "--offload-optimizer", "cpu")),
    (2, [], ep(2, "--zero-stage", "2", "--offload-optimizer", "cpu")),
    (2, [], ep(2, "--zero-stage", "3", "--offload-params", "cpu", "--offload-optimizer", "cpu")),
    (4, LLAMA, ep(2, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size",
                  "2")),
    (4, LLAMA, ep(1, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size",
                  "1")),
    (2, ["--moe-router-topk", "1", "--moe-router-pre-softmax"], ep(2)),
    (4, ["--num-experts", "8", "--moe-router-topk", "8"], ep(4)),
    (2, ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"], ep(2)),
    (2, ["--moe-router-load-balancing-type", "seq_aux_loss"], ep(2)),
    (4, ["--moe-router-num-groups", "2", "--moe-router-group-topk", "1"], ep(4)),
    (2, ["--moe-expert-capacity-factor", "0.5", "--moe-token-drop-policy", "position"], ep(2)),
    (2, ["--moe-layer-freq", "[0,1]"], ep(2)),
    (2, [], ep(2, "--recompute-granularity", "full", "--recompute-method", "uniform")),
    (4, LLAMA + SHARED_SIGMOID, ep(4, "--moe-token-dispatcher-type", "allgather")),
    (2, [], ep(1, "--pipeline-model-parallel-size", "2", "--enable-zero-bubble")),
    (2, ["--moe-router-dtype", "fp64"], ep(2)),
    (2, ["--moe-grouped-gemm"], ep(2)),
    (4, LLAMA + SHARED_SIGMOID, ep(2, "--tensor-model-parallel-size", "2", "--sequence-parallel")),
    (4, LLAMA + SHARED_SIGMOID + SCALED + ["--moe-router-enable-expert-bias"],
     ep(2, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1")),
    (4, LLAMA + ["--moe-router-load-balancing-type", "seq_aux_loss", "--moe-expert-capacity-factor", "0.75"],
     ep(2, "--tensor-model-parallel-size", "2", "--sequence-parallel")),
    (4, LLAMA, ep(2, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-activations")),
    (2, [], ep(2, "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1")),
    (2, [], ep(2, "--offload-activations", "cpu")),
    (4, ["--num-layers", "4"], ep(2, "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank",
                                  "2")),
], ids=["zero0", "zero1", "zero2", "zero3", "ep4", "offload-optimizer", "zero2-offload-optimizer",
                                                              "zero3-offload-params", "tp2-etp2-ep2", "tp2-etp1-ep1", "top1",
        "top8", "expert-bias", "seq-aux-loss", "group-limited", "capacity-position", "layer-freq", "full-recompute",
        "allgather-ep4", "pp2-zero-bubble", "router-fp64", "grouped-gemm", "tp2-sp-shared",
        "tp2-sp-etp1-shared-sigmoid-bias-scaling", "tp2-sp-seq-aux-capacity",
        "tp2-sp-selective", "full-block", "offload-activations",
        "pp2-interleaved-ep2"])
def test_expert_parallel_compositions_match_one_process(world, model, layout):
    _assert_matches_one_process(world, model, layout)


def test_the_topk_scaling_factor_changes_what_is_trained():
    """2.5 x every gate (DeepSeek-V3's routed_scaling_factor): the experts' share of each layer's output and so the
    losses differ from the unscaled run's (the EP 2 run of `topk-scaling-ep2` equals this one process)."""
    scaled, plain = _reference(BASE + SCALED)["losses"], _reference(BASE)["losses"]
    assert len(scaled) == len(plain) and all(abs(a - b) > 1e-4 * abs(b) for a, b in zip(scaled, plain))


FIGURES = re.compile(r"load_balancing_loss: (\S+) \| z_loss: (\S+) \|")


def _logged(argv):
    return main_capturing_stdout(argv)[1]


def test_the_log_line_says_the_auxiliary_losses_and_the_tokens_per_expert():
    """The iteration line carries the load-balancing and z-losses (Megatron's averages over layers and
    micro-batches, divided by their coefficients), the same at EP 2 and over two pipeline stages as in one
    process; a line per MoE layer says
    how many tokens each expert received (every token k times: 2 x 8 x 16 per layer); the EP bytes counted equal
    their formula."""
    argv = BASE + ["--log-interval", "1", "--train-iters", "2"]
    one = run_ranks(1, _logged, argv)[0]
    two = run_ranks(2, _logged, argv + ep(2))[0]
    stages = run_ranks(2, _logged, argv + ["--pipeline-model-parallel-size", "2"])[-1]  # the last stage logs
    assert_close_lists([v for m in FIGURES.findall(stages) for v in map(float, m)],
                       [v for m in FIGURES.findall(one) for v in map(float, m)])
    for out in (one, two):
        figures = [tuple(map(float, m)) for m in FIGURES.findall(out)]
        assert len(figures) == 2 and all(v > 0 for f in figures for v in f), out
        tokens = [list(map(int, line.split("|")[-1].split())) for line in out.splitlines()
                  if line.startswith("moe tokens per expert")]
        assert len(tokens) == 4 and all(sum(row) == 2 * 8 * 16 and len(row) == 4 for row in tokens), out
    assert_close_lists([v for m in FIGURES.findall(two) for v in map(float, m)],
                       [v for m in FIGURES.findall(one) for v in map(float, m)])
    ratios = re.findall(r"moe comm \| ep 2 \| dispatcher alltoall \| measured bytes/iter (\d+) \| theory bytes/iter "
                        r"(\d+) \| ratio 1.0000", two)
    assert len(ratios) == 2 and all(int(a) > 0 for a, _ in ratios), two
    # the dense and expert families each on their own group, counted = formula exactly: memory and DP bytes
    assert re.search(r"zero memory \| stage 1 \| dp 2 \| params \d+ \| expert params \d+ \| expert dp 1 \| .* "
                     r"formula 8P\+8P/N\+8Pe\+8Pe/Ne \| formula bytes \d+ \| ratio 1.0000", two), two
    comm = re.findall(r"zero comm .* measured bytes/iter (\d+) \| theory \S+ \| theory bytes/iter (\d+)", two)
    assert len(comm) == 2 and all(measured == theory for measured, theory in comm), comm


@pytest.mark.product
def test_bf16_experts_match_one_bf16_process_within_rounding():
    """bf16 weights and activations, the router's logits and the gates' weighted sum in fp32: EP 2 sums each
    expert's weight gradient over the ranks' tokens in another order than one process, in bf16: within 1e-2."""
    reference = _reference(BASE + LLAMA + ["--bf16"])
    history = run_ranks(2, quiet_main, BASE + LLAMA + ["--bf16"] + ep(2))[0]
    assert_close_lists(history["losses"], reference["losses"], rel=1e-2)


@pytest.mark.product
def test_optimizer_states_on_disk_at_ep_2(tmp_path):
    """--offload-optimizer disk at ZeRO 1: the masters and moments of both families in the rank's one file."""
    _assert_matches_one_process(2, [], ep(2, "--zero-stage", "1", "--offload-optimizer", "disk", "--offload-path",
                                         str(tmp_path)))


def test_zero3_lines_count_each_family_on_its_group():
    """ZeRO 3 at EP 2 x DP 4 (experts partitioned over 2 expert-DP ranks), linear units replayed by full
    recomputation: the memory line's formula (16P/N + 16Pe/Ne) and the comm line's, each family's third gathers
    (X, Xe) over its own group, equal the counts to the byte."""
    argv = BASE + ["--log-interval", "1", "--train-iters", "2", "--zero-stage", "3", "--zero-units", "linear",
                   "--recompute-granularity", "full", "--recompute-method", "uniform"] + ep(2)
    out = run_ranks(4, _logged, argv)[0]
    assert re.search(r"zero memory \| stage 3 \| dp 4 \| .* expert dp 2 \| .* formula 16P/N\+16Pe/Ne \| .* "
                     r"ratio 1.0000", out), out
    comm = re.findall(r"zero comm .* measured bytes/iter (\d+) \| theory \(12P\+4X\)\(N-1\)/N\+\(12Pe\+4Xe\)\(Ne-1\)"
                      r"/Ne \| theory bytes/iter (\d+)", out)
    assert len(comm) == 2 and all(measured == theory for measured, theory in comm), out
