"""Mixture of experts with context parallelism through the command line (pretrain_gpt.main on forked gloo ranks),
dropout off, fp32: each CP rank routes the tokens of its part of the sequences through the same MoE layers, the
expert grid folded over TP x CP x DP (Megatron's parallel folding: EP may take CP ranks), and the run trains one
process's losses, validation losses and gradient norms within 1e-5 relative with the load-balancing loss (aux_loss
and seq_aux_loss: counts summed over the CP ranks), the z-loss and the expert bias on; the log's auxiliary losses
are one process's, and every activation, cp comm (the attention's exchanges and the counts' all-reduce) and moe
comm line counts its formula. A checkpoint saved at CP 2 x EP 2 resumes in one process at the uninterrupted losses.
"""

import re

import pytest

from tests.cli import assert_close_lists, main_capturing_stdout, quiet_main
from tests.distributed import run_ranks
from tests.test_moe_layouts import BASE, LLAMA

AUX = re.compile(r"load_balancing_loss: (\S+) \| z_loss: (\S+) \|")
BIAS = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
        "1e-2"]


def cp(size, comm, ep=1, *more):
    return ["--context-parallel-size", str(size), "--cp-comm-type", comm, "--expert-model-parallel-size", str(ep),
            *more]


def _logged(argv):
    return main_capturing_stdout(argv)


def _assert_counted_equals_formula(stdout: str) -> None:
    """Every activation, cp comm and moe comm line the ranks printed says ratio 1.0000 (all three printed)."""
    lines = [line for line in stdout.splitlines()
             if line.startswith(("activation memory", "cp comm", "moe comm"))]
    assert {line.split(" |")[0].split(" rank")[0] for line in lines} == {"activation memory", "cp comm", "moe comm"}
    for line in lines:
        ratios = re.findall(r"ratio (\d+\.\d+)", line)
        assert ratios and all(r == "1.0000" for r in ratios), line


def _assert_like_one_process(world: int, model: list[str], layout: list[str]) -> None:
    argv = BASE + ["--log-interval", "1", "--train-iters", "2"] + model
    one = run_ranks(1, _logged, argv)[0]
    runs = run_ranks(world, _logged, argv + layout, deadline=300)
    for history, _ in runs:
        for key in ("losses", "valid_losses", "grad_norms"):
            assert_close_lists(history[key], one[0][key])
    _assert_counted_equals_formula("\n".join(stdout for _, stdout in runs))
    logging = [stdout for _, stdout in runs if AUX.search(stdout)]
    assert logging and len(AUX.findall(one[1])) == 2
    assert_close_lists([float(v) for m in AUX.findall(logging[-1]) for v in m],
                       [float(v) for m in AUX.findall(one[1]) for v in m])


@pytest.mark.parametrize("world,model,layout", [
    (4, [], cp(2, "p2p", 2)),
    (2, LLAMA + BIAS + ["--moe-router-load-balancing-type", "seq_aux_loss"], cp(2, "all_gather", 1)),
], ids=["gpt-cp2-ep2-p2p", "llama-cp2-ep1-all_gather-bias-seq_aux"])
def test_experts_under_context_parallelism_match_one_process(world, model, layout):
    _assert_like_one_process(world, model, layout)


@pytest.mark.product
@pytest.mark.parametrize("world,model,layout", [
    (8, [], cp(2, "a2a", 2, "--tensor-model-parallel-size", "2", "--sequence-parallel",
               "--expert-tensor-parallel-size", "1")),
    (8, LLAMA + BIAS, cp(2, "p2p", 2, "--tensor-model-parallel-size", "2", "--sequence-parallel")),
    (4, LLAMA + ["--moe-router-load-balancing-type", "seq_aux_loss"], cp(2, "a2a", 4)),
    (4, LLAMA + ["--moe-shared-expert-intermediate-size", "32"], cp(2, "all_gather", 2, "--zero-stage", "3")),
    (4, [], cp(2, "p2p", 2, "--moe-token-dispatcher-type", "allgather", "--recompute-granularity", "full",
               "--recompute-method", "uniform")),
    (4, [], cp(2, "p2p", 2, "--pipeline-model-parallel-size", "2")),
    (4, [], cp(4, "all_gather", 2)),
], ids=["tp2-cp2-etp1-ep2-sp-a2a", "llama-tp2-cp2-ep2-sp-bias", "llama-cp2-ep4-a2a-seq_aux", "llama-shared-zero3",
        "allgather-full-recompute", "cp2-pp2-ep2", "cp4-ep2"])
def test_experts_under_context_parallelism_compose(world, model, layout):
    _assert_like_one_process(world, model, layout)


def test_a_checkpoint_saved_at_cp2_ep2_resumes_in_one_process(tmp_path):
    """Saved at CP 2 x EP 2 (DP 2, ZeRO 1) after 3 of 5 iterations with the expert bias moving, resumed at CP 1 x
    EP 1: iterations 4-5 are the uninterrupted run's."""
    argv = BASE + ["--train-iters", "5", "--eval-iters", "0"] + BIAS
    uninterrupted = run_ranks(1, quiet_main, argv)[0]
    run_ranks(4, quiet_main, argv + cp(2, "p2p", 2, "--zero-stage", "1") + ["--save", str(tmp_path),
                                                                             "--exit-interval", "3"], deadline=300)
    resumed = run_ranks(1, quiet_main, argv + ["--load", str(tmp_path)])[0]
    assert_close_lists(resumed["losses"], uninterrupted["losses"][3:])
    assert_close_lists(resumed["grad_norms"], uninterrupted["grad_norms"][3:])
