"""--qk-layernorm (Megatron's flag; Qwen3's q_norm and k_norm): --normalization over each head's queries and keys
before RoPE (mpzero/models/attention.py), what it keeps (mpzero/activations/qk_norm.py) and sends over TP
(models/family.py's TP traffic):
  - at TP 2 the losses and gradient norms are one process's: the [head_dim] weights see other heads on each TP
    rank, so their gradients are summed over TP;
  - the run's activation line counts what the formula says (ratio 1.0000 for the layers and the micro-batch) in
    fp32 and bf16, on the flash and local paths, with and without RoPE, and with q regrouped (GQA, 2 groups per
    rank);
  - the dry run's TP bytes per iteration equal the planner's (the norms' weight gradients all-reduced)."""

import pytest

from tests.cli import assert_close_lists, main_capturing_stdout
from tests.distributed import run_ranks
from tests.test_llama import LLAMA

QK = LLAMA + ["--qk-layernorm"]


def test_qk_layernorm_at_tp2_matches_single_process():
    argv = QK + ["--train-iters", "4", "--eval-iters", "0"]
    one = run_ranks(1, main_capturing_stdout, argv)[0][0]
    tp2 = run_ranks(2, main_capturing_stdout, argv + ["--tensor-model-parallel-size", "2"])[0][0]
    assert_close_lists(tp2["losses"], one["losses"])
    assert_close_lists(tp2["grad_norms"], one["grad_norms"])


@pytest.mark.parametrize("tp, extra", [
    (2, []), (2, ["--bf16"]), (2, ["--attention-backend", "local"]),
    (2, ["--position-embedding-type", "none", "--bf16"]),
    (1, []), (1, ["--position-embedding-type", "none", "--bf16"]), (1, ["--attention-backend", "local", "--bf16"]),
], ids=["flash", "bf16", "local", "no-rope-bf16", "regrouped", "regrouped-no-rope-bf16", "regrouped-local-bf16"])
def test_the_activation_line_counts_the_formula(tp, extra):
    argv = QK + extra + ["--tensor-model-parallel-size", str(tp), "--train-iters", "1", "--eval-iters", "0"]
    stdout = run_ranks(tp, main_capturing_stdout, argv)[0][1]
    line = next(line for line in stdout.splitlines() if line.startswith("activation memory rank 0"))
    assert "q/k norms normalized fp32" in line and line.count("ratio 1.0000") == 2, line


def test_the_dry_runs_tp_bytes_are_the_planners():
    argv = QK + ["--tensor-model-parallel-size", "2", "--zero-stage", "3", "--train-iters", "1", "--dry-run",
                 "--world-size", "4", "--rank", "0"]
    for sp in ([], ["--sequence-parallel"]):
        _, stdout = main_capturing_stdout(argv + sp)
        planner = next(line for line in stdout.splitlines() if line.startswith("planner |"))
        tp_bytes = next(part for part in planner.split(" | ") if part.startswith("TP bytes/iter")).split()
        assert tp_bytes[2] == tp_bytes[4], planner
