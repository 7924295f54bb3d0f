"""The planner and `pretrain_gpt.py --dry-run` with experts (issue 44, item 5).

- The dry run routes balanced (slot i of a rank's slots to expert i mod E: `mpzero.moe.balanced_routing`, only
  there) and runs the real dispatch, experts and ZeRO code; every figure it counts (model states, the ZeRO peak
  and construction, DP, TP, CP, EP and pipeline bytes, activations) equals the planner's at the same layout, with
  context parallelism too (tests/test_moe_plan_context.py has its other checks).
- The model-state and DP lines do not depend on the routing: a real 4-rank gloo run prints the dry run's lines
  character for character, so the planner's expert bytes are training's counted ones.
- tools/plan_memory.py enumerates EP and expert-TP for a model with experts, states the routing it plans with.
"""

import json
import re

import pytest
import torch.distributed as dist

import pretrain_gpt
from mpzero.cli.arguments import parse_args, run_config
from mpzero.cli.dry_run import dry_run
from mpzero.moe import balanced_counts
from mpzero.planner.published import PUBLISHED_MOE
from tests.cli import main_capturing_stdout
from tests.distributed import run_ranks
from tests.test_planner import _plan

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "1", "--lr", "1e-3",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data", "--vocab-size", "128",
        "--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-aux-loss-coeff", "1e-2",
        "--moe-z-loss-coeff", "1e-3", "--moe-token-dispatcher-type", "alltoall"]
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--no-position-embedding",
         "--disable-bias-linear", "--group-query-attention", "--num-query-groups", "2"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
CP2 = ["--context-parallel-size", "2", "--attention-dropout", "0"]
EP2 = ["--expert-model-parallel-size", "2"]


def _dry(argv: list[str], world: int, rank: int) -> dict:
    try:
        run = run_config(parse_args(BASE + argv), world)
        return dry_run(run, pretrain_gpt._provider(run), world, rank)
    finally:
        dist.destroy_process_group()


def _different(result: dict) -> list:
    return [(name, mine, theirs) for name, mine, theirs in result["checks"] if abs(mine - theirs) > 0.5]


FAST = {
    "ep2-zero1": (["--expert-model-parallel-size", "2", "--zero-stage", "1"], 4, 1),
    "ep4-zero2": (["--expert-model-parallel-size", "4", "--zero-stage", "2"], 4, 3),
    "ep2-zero3": (["--expert-model-parallel-size", "2", "--zero-stage", "3"], 4, 2),
    "tp2-ep2-etp2": (TP2 + LLAMA + ["--expert-model-parallel-size", "2", "--zero-stage", "1"], 4, 1),
    "tp2-ep2-etp1-shared-block": (TP2 + LLAMA + ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size",
                                                 "1", "--moe-shared-expert-intermediate-size", "32",
                                                 "--recompute-granularity", "full", "--recompute-method", "block",
                                                 "--recompute-num-layers", "1"], 4, 3),
    "pp2-ep2": (["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--zero-stage", "1"],
                4, 3),
    # context parallelism: each CP rank routes its s/CP tokens; the counts' all-reduce on the cp comm line
    "cp2-ep2": (CP2 + EP2 + ["--zero-stage", "1"], 4, 1),
    "tp2-cp2-ep2-sp": (TP2 + LLAMA + CP2 + EP2 + ["--zero-stage", "1"], 8, 5),
    "cp2-pp2-ep2": (CP2 + EP2 + ["--pipeline-model-parallel-size", "2", "--zero-stage", "1"], 8, 5),
}
PRODUCT = {
    "ep2-zero0": (["--expert-model-parallel-size", "2", "--zero-stage", "0"], 4, 0),
    "ep1-zero1": (["--zero-stage", "1"], 2, 1),
    "allgather": (["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "allgather"], 4, 2),
    "uniform-full": (["--expert-model-parallel-size", "2", "--recompute-granularity", "full", "--recompute-method",
                      "uniform", "--recompute-num-layers", "1"], 4, 1),
    "offload-cpu": (["--expert-model-parallel-size", "2", "--zero-stage", "3", "--offload-optimizer", "cpu",
                     "--offload-params", "cpu"], 4, 1),
    "seq-aux-bf16": (TP2 + ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--zero-stage",
                            "2", "--moe-router-load-balancing-type", "seq_aux_loss", "--bf16",
                            "--moe-shared-expert-intermediate-size", "32"], 4, 0),
    "fp64-router-pattern": (TP2 + LLAMA + ["--expert-model-parallel-size", "2", "--zero-stage", "3",
                                           "--moe-router-dtype", "fp64", "--moe-layer-freq", "[1,0]",
                                           "--recompute-granularity", "full", "--recompute-method", "uniform",
                                           "--recompute-num-layers", "1"], 4, 2),
    "sigmoid-bias-groups-shared": (LLAMA + ["--expert-model-parallel-size", "4", "--moe-shared-expert-intermediate-"
                                            "size", "32", "--moe-router-score-function", "sigmoid",
                                            "--moe-router-enable-expert-bias", "--moe-router-num-groups", "2",
                                            "--moe-router-group-topk", "1", "--moe-layer-freq", "[0,1]"], 4, 1),
    "capacity-1": (["--expert-model-parallel-size", "2", "--moe-expert-capacity-factor", "1.0"], 4, 1),
    "top3-uneven": (["--expert-model-parallel-size", "2", "--moe-router-topk", "3"], 4, 1),  # D k = 96: 24 each
    "tp2-cp2-ep2-etp1-seq-aux-zero3": (TP2 + LLAMA + CP2 + EP2 + ["--expert-tensor-parallel-size", "1",
                                                                 "--moe-router-load-balancing-type", "seq_aux_loss",
                                                                 "--zero-stage", "3"], 8, 6),
    "cp2-all-gather-ep4-allgather-sigmoid-bias-full": (
        LLAMA + CP2 + ["--cp-comm-type", "all_gather", "--expert-model-parallel-size", "4",
                       "--moe-token-dispatcher-type", "allgather", "--moe-router-score-function", "sigmoid",
                       "--moe-router-enable-expert-bias", "--recompute-granularity", "full", "--recompute-method",
                       "uniform", "--recompute-num-layers", "1", "--zero-stage", "2"], 4, 3),
    "cp2-a2a-ep2-shared-zero2": (CP2 + EP2 + ["--cp-comm-type", "a2a", "--moe-shared-expert-intermediate-size",
                                              "32", "--zero-stage", "2"], 4, 2),
}


@pytest.mark.parametrize("argv,world,rank", FAST.values(), ids=FAST.keys())
def test_dry_run_with_experts_equals_the_planner(argv, world, rank):
    result = _dry(argv, world, rank)
    assert result["equal"], _different(result)
    names = {name for name, _, _ in result["checks"]}
    assert {"model-state bytes", "DP bytes/iter", "activation bytes", "EP bytes/iter"} <= names
    assert ("CP bytes/iter" in names) == ("--context-parallel-size" in argv)


@pytest.mark.product
@pytest.mark.parametrize("argv,world,rank", PRODUCT.values(), ids=PRODUCT.keys())
def test_dry_run_with_experts_equals_the_planner_at_more_layouts(argv, world, rank):
    result = _dry(argv, world, rank)
    assert result["equal"], _different(result)


def test_the_dry_run_states_its_routing_and_counts_the_balanced_rows(capsys):
    _dry(["--expert-model-parallel-size", "2", "--moe-router-topk", "3"], 4, 1)
    out = capsys.readouterr().out
    assert "moe routing | the dry run routes balanced" in out and "dropless worst case R 128" in out  # EP D min(k, E_l)
    # D k = 2 x 16 x 3 = 96 slots a rank, 24 to each of the 4 experts: EP rank 1's two experts get 2 x 2 x 24 rows
    assert balanced_counts(96, 4) == [24] * 4 and balanced_counts(6, 4) == [2, 2, 1, 1]
    assert "R 96 rows counted" in out and "balanced (tokens x topk / E per expert) R 96" in out


REAL = {"ep2-zero1": ["--expert-model-parallel-size", "2", "--zero-stage", "1"]}
MORE_REAL = {"tp2-etp1-zero3": TP2 + LLAMA + ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size",
                                              "1", "--zero-stage", "3"],
             "ep4-zero2": ["--expert-model-parallel-size", "4", "--zero-stage", "2"],
             "ep1-zero0": ["--zero-stage", "0"],
             "tp2-etp2-zero0": TP2 + LLAMA + ["--expert-model-parallel-size", "2", "--zero-stage", "0"],
             "pp2-ep2-zero1": ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                               "--zero-stage", "1"]}


@pytest.mark.parametrize("argv", list(REAL.values()) + [pytest.param(v, marks=pytest.mark.product)
                                                         for v in MORE_REAL.values()],
                         ids=list(REAL) + list(MORE_REAL))
def test_a_real_run_prints_the_dry_runs_model_state_and_dp_lines(argv):
    argv = BASE + argv + ["--log-interval", "1"]
    real = re.sub(r"pipeline stage \d+ \| ", "", "".join(out for _, out in run_ranks(4, main_capturing_stdout, argv)))
    rank = "2" if "--pipeline-model-parallel-size" in argv else "0"  # the rank that logs: the last stage's first
    _, dry = main_capturing_stdout(argv + ["--dry-run", "--world-size", "4", "--rank", rank])
    for kind in ("zero memory", "zero comm"):
        lines = [line for line in dry.splitlines() if line.startswith(kind)]
        assert lines and all(line in real for line in lines), kind
    assert "| equal" in dry


def test_the_planner_enumerates_expert_grids_and_states_its_routing():
    argv = ["--world-size", "4", "--device-memory", "1", "--device", "cpu", "--json", "--zero-stages", "1,2",
            "--recompute-modes", "none", "--disk-space", "100"] + BASE
    code, stdout, stderr = _plan(*argv)
    assert code == 0, stderr
    layouts = json.loads(stdout)["layouts"]
    grids = {(x["layout"]["tp"], x["layout"]["ep"], x["layout"]["expert_tp"]) for x in layouts}
    assert {(1, 1, None), (1, 2, None), (1, 4, None), (2, 2, 1), (2, 4, 1)} <= grids
    assert not any(tp > 1 and etp is None for tp, _, etp in grids)  # GPT-2's expert biases need expert-TP 1
    assert all(x["layout"]["sequence_parallel"] for x in layouts if x["layout"]["tp"] > 1)  # MoE's rule
    moe = [x for x in layouts if x["layout"]["ep"] > 1]
    assert all(x["ep_bytes_per_iter_balanced"] > 0 for x in moe)
    assert all(x["activations_balanced"] <= x["activations_saved"] for x in layouts)  # the bound is the worst case
    assert all("dropless worst case" in x["activation_routing"] for x in layouts)
    tiers = {(x["layout"]["stage"], x["layout"]["offload_optimizer"]) for x in layouts}
    assert (1, "disk") in tiers and (2, "disk") not in tiers  # training's rule: no disk tier for expert gradients


def test_the_planners_layout_dry_runs_equal():
    """The planner's best layout, dry-run through the command it prints: `equal`."""
    argv = ["--world-size", "4", "--device-memory", "1", "--device", "cpu", "--zero-stages", "3",
            "--recompute-modes", "none", "--micro-batch-sizes", "2", "--ep-sizes", "2"] + BASE
    code, stdout, stderr = _plan(*argv)
    assert code == 0, stderr
    dry = stdout.split("python pretrain_gpt.py ", 1)[1].split()
    _, out = main_capturing_stdout(dry[1:] if dry[0] == "pretrain_gpt.py" else dry)
    assert "| equal" in out, out[-2000:]


@pytest.mark.product
@pytest.mark.parametrize("row,rank", [(PUBLISHED_MOE[0], 0), (PUBLISHED_MOE[1], 128), (PUBLISHED_MOE[2], 7)],
                         ids=["mixtral", "deepseek-v3", "qwen3-30b-a3b"])
def test_published_moe_layouts_dry_run_equal(row, rank):
    """Mixtral 8x7B (rank 0 of 32, about 10 s here on meta tensors), the DeepSeek-V3-sized MoE (rank 128 of 2048,
    a pipeline rank of MoE layers, about 5 s) and Qwen3-30B-A3B (rank 7 of 8: the last stage's, TP 4 x EP 4, about
    20 s) at their published layouts: every figure the planner's."""
    argv = list(row.model) + list(row.layout) + ["--train-iters", "1", "--lr", "1e-4", "--mock-data"]
    try:
        run = run_config(parse_args(argv), row.world)
        result = dry_run(run, pretrain_gpt._provider(run), row.world, rank)
    finally:
        dist.destroy_process_group()
    assert result["equal"], _different(result)
    assert result["max_rss"] < 4 * 2 ** 30
