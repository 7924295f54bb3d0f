"""The planner and `pretrain_gpt.py --dry-run` with experts and context parallelism (issue 44).

Each CP rank routes the tokens it holds (s/CP per sequence): the planner's MoE activation terms, its MoE TP bytes
and EP bytes are per CP rank, and its CP bytes add the load-balancing counts' all-reduce over CP (2(CP-1)/CP x 8E
per MoE layer and micro-batch; 8bE with seq_aux_loss), the `cp comm` line's own formula. The dry runs at CP x EP
layouts (every figure the planner's) are tests/test_moe_plan.py's; here a real run prints the dry run's
model-state, DP and CP lines, the planner enumerates CP with experts, and both dry-run engines agree.
"""

import json
import re

import pytest
import torch.distributed as dist

import pretrain_gpt
from mpzero.cli.arguments import parse_args, run_config
from mpzero.cli.dry_run import dry_run
from mpzero.context_parallel import block_kernel
from tests.cli import main_capturing_stdout
from tests.distributed import run_ranks
from tests.test_moe_plan import BASE, CP2, EP2, LLAMA, _dry
from tests.test_planner import _plan


@pytest.mark.parametrize("cp", [[], CP2], ids=["cp1", "cp2"])
def test_both_engines_print_the_same_lines_with_experts(capsys, cp):
    """Meta tensors run the CPU's kernels (SDPA's flash; CP's flash blocks), as fake tensors (device cpu) do: on the
    math path the meta engine counted 16,128 B more per MoE layer (the attention's, not the experts')."""
    assert block_kernel("auto", "meta") == block_kernel("auto", "cpu") == "flash"
    outputs = []
    for engine in ("meta", "fake"):
        run = run_config(parse_args(BASE + LLAMA + cp + EP2), 4)
        try:
            assert dry_run(run, pretrain_gpt._provider(run), 4, 1, engine=engine)["equal"]
        finally:
            dist.destroy_process_group()
        out = capsys.readouterr().out
        outputs.append([line for line in out.splitlines() if line.startswith(("zero", "activation", "cp", "moe"))])
    assert outputs[0] == outputs[1]
    kinds = {"zero memory", "zero comm", "moe routing", "moe comm", "activation memory rank 1"} | (
        {"cp comm"} if cp else set())
    assert {line.split(" |")[0] for line in outputs[0]} == kinds


def test_the_cp_line_counts_the_load_balancing_counts(capsys):
    _dry(CP2 + EP2, 4, 0)
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("cp comm"))
    # 2 micro-batches x 2 MoE layers x 2(CP-1)/CP x 8E bytes over the attention's K/V exchanges (65,536 B)
    assert "+m2(2(CP-1)/CP)8E" in line and "theory bytes/iter 65664" in line, line


@pytest.mark.product  # 8 s; the CP x EP dry runs equal to the planner stay in make test
def test_a_real_run_at_cp2_ep2_prints_the_dry_runs_state_dp_and_cp_lines():
    argv = BASE + CP2 + EP2 + ["--zero-stage", "1", "--log-interval", "1"]
    real = "".join(out for _, out in run_ranks(4, main_capturing_stdout, argv))
    _, dry = main_capturing_stdout(argv + ["--dry-run", "--world-size", "4", "--rank", "0"])
    for kind in ("zero memory", "zero comm", "cp comm"):
        lines = [line for line in dry.splitlines() if line.startswith(kind)]
        assert lines and all(line in real for line in lines), kind
    assert "| equal" in dry


def test_the_planner_enumerates_cp_with_experts_and_its_best_such_layout_dry_runs_equal():
    argv = ["--world-size", "4", "--device-memory", "1", "--device", "cpu", "--json", "--zero-stages", "1",
            "--recompute-modes", "none", "--micro-batch-sizes", "2", "--cp-sizes", "1,2", "--attention-dropout",
            "0"] + BASE
    code, stdout, stderr = _plan(*argv)
    assert code == 0, stderr
    layouts = json.loads(stdout)["layouts"]
    grids = {(x["layout"]["tp"], x["layout"]["cp"], x["layout"]["ep"]) for x in layouts}
    assert {(1, 2, 1), (1, 2, 2), (1, 2, 4), (2, 2, 2)} <= grids
    cp_ep = [x for x in layouts if x["layout"]["cp"] == 2 and x["layout"]["ep"] > 1]
    assert all(x["cp_bytes_per_iter"] > 0 and x["ep_bytes_per_iter_balanced"] > 0 for x in cp_ep)
    code, stdout, stderr = _plan(*[a for a in argv if a != "--json"], "--context-parallel-size", "2",
                                 "--expert-model-parallel-size", "2")
    assert code == 0, stderr
    dry = stdout.split("python pretrain_gpt.py ", 1)[1].split()
    assert re.search(r"--context-parallel-size 2 .*--expert-model-parallel-size 2", " ".join(dry))
    _, out = main_capturing_stdout(dry[1:] if dry[0] == "pretrain_gpt.py" else dry)
    assert "| equal" in out, out[-2000:]
