"""Context parallelism with pipeline parallelism through the CLI (CP 2 x PP 2, and TP 2 x CP 2 x PP 2 with SP): dropout
off, fp32, the losses, printed gradient norms and validation losses of one process within 1e-5 relative for 1F1B,
interleaved and ZB-H1, GPT-2 (learned positions, the tied embedding's two copies) and LLaMA (RoPE, GQA), each comm
type; the stages send s/CP tokens' hidden states and every activation, CP and pipeline byte line equals its formula;
a checkpoint saved at CP 2 x PP 2 resumes in one process at the uninterrupted losses; the dry run of a CP x PP rank
equals the planner, and the planner lays CP and PP out together."""

import re

import pytest

from mpzero.cli.arguments import parse_args, planner_sections, run_config
from mpzero.context_parallel import cp_comm_theory
from mpzero.pipeline import stage_layers
from mpzero.planner import Machine, Planner
from tests.cli import TINY, assert_close_lists, main_capturing_stdout, quiet_main
from tests.distributed import run_ranks
from tests.test_context_parallel import _documents
from tests.test_pipeline import BASE, LLAMA

MODELS = {"gpt2": [], "llama": LLAMA}
_REFERENCES: dict = {}


def _reference(model: str, extra: tuple = ()) -> dict:
    """One process's run of `model`, once per session."""
    key = (model, extra)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_ranks(1, quiet_main, BASE + MODELS[model] + list(extra))[0]
    return _REFERENCES[key]


def _assert_counted_equals_formula(stdout: str) -> None:
    """Every stage's activation, cp comm and pipeline comm lines: each ratio 1.0000."""
    lines = [line for line in stdout.splitlines()
             if line.startswith(("activation memory", "cp comm", "pipeline comm"))]
    for kind in ("activation memory", "cp comm | pipeline stage 1", "pipeline comm | stage 1"):
        assert any(line.startswith(kind) for line in lines), kind
    for line in lines:
        ratios = re.findall(r"ratio (\S+)", line)
        assert ratios and all(r == "1.0000" for r in ratios), line


def _layout_matches_one_process(model: str, comm: str, flags: tuple, tp: int = 1, dp: int = 1) -> None:
    argv = BASE + MODELS[model] + ["--log-interval", "1", "--context-parallel-size", "2", "--cp-comm-type", comm,
                                   "--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", str(tp),
                                   *flags]
    results = run_ranks(4 * tp * dp, main_capturing_stdout, argv, deadline=300)
    reference = _reference(model)
    for history, _ in results:  # every rank: the last stage's loss, given to all
        for key in ("losses", "grad_norms", "valid_losses"):
            assert_close_lists(history[key], reference[key])
    _assert_counted_equals_formula("".join(stdout for _, stdout in results))  # the logging rank's, and others'


VIRTUAL, ZB = ("--num-virtual-stages-per-pipeline-rank", "2"), ("--enable-zero-bubble",)
BLOCK = ("--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1")
FAST = [("gpt2", "p2p", ()), ("llama", "all_gather", VIRTUAL), ("llama", "a2a", ZB + BLOCK)]
PRODUCT = [("gpt2", "all_gather", ZB), ("gpt2", "a2a", VIRTUAL), ("llama", "p2p", ()),
           ("gpt2", "p2p", VIRTUAL + ("--recompute-activations",)), ("llama", "p2p", ZB),
           ("gpt2", "p2p", ("--recompute-granularity", "full")), ("llama", "all_gather", ("--zero-stage", "2")),
           ("gpt2", "all_gather", ("--offload-optimizer", "cpu", "--offload-activations", "cpu")),
           ("llama", "p2p", ("--decoder-first-pipeline-num-layers", "1", *BLOCK[:-1], "2"))]  # stages of 1 and 3


@pytest.mark.parametrize("model,comm,flags", FAST + [pytest.param(*case, marks=pytest.mark.product)
                                                     for case in PRODUCT])
def test_cp2_pp2_matches_one_process(model, comm, flags):
    _layout_matches_one_process(model, comm, flags)


@pytest.mark.parametrize("model,comm,flags", [("gpt2", "p2p", ()), pytest.param("llama", "all_gather", VIRTUAL,
                                                                                 marks=pytest.mark.product)])
def test_tp2_cp2_pp2_with_sequence_parallelism_matches_one_process(model, comm, flags):
    _layout_matches_one_process(model, comm, ("--sequence-parallel", *flags), tp=2)


@pytest.mark.product
@pytest.mark.parametrize("stage", [1, 2])
def test_cp2_pp2_dp2_matches_one_process(stage):
    _layout_matches_one_process("gpt2", "p2p", ("--zero-stage", str(stage)), dp=2)


@pytest.mark.product
def test_documents_ending_inside_chunks_train_like_one_process(tmp_path):
    argv = _documents(tmp_path) + LLAMA
    reference = run_ranks(1, quiet_main, argv)[0]
    history = run_ranks(4, quiet_main, argv + ["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
                        deadline=300)[-1]
    for key in ("losses", "grad_norms", "valid_losses"):
        assert_close_lists(history[key], reference[key])


@pytest.mark.parametrize("saved,loaded", [((4, ()), (1, ())), pytest.param(
    (8, ("--tensor-model-parallel-size", "2")), (4, ("--pipeline-model-parallel-size", "4")),
    marks=pytest.mark.product)])
def test_a_checkpoint_saved_at_cp2_pp2_resumes_at_another_layout(tmp_path, saved, loaded):
    """Saved at iteration 2 of CP 2 x PP 2 (ZeRO-1 over DP x CP; also with TP 2), resumed in one process (or at
    PP 4): iterations 3-4 are those of one process that never stopped."""
    argv = BASE + ["--train-iters", "4", "--eval-iters", "0"]
    uninterrupted = run_ranks(1, quiet_main, argv)[0]
    (world, flags), (loaded_world, loaded_flags) = saved, loaded
    saved_argv = argv + ["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2", *flags]
    run_ranks(world, quiet_main, saved_argv + ["--save", str(tmp_path), "--exit-interval", "2"], deadline=300)
    resumed = run_ranks(loaded_world, quiet_main, argv + [*loaded_flags, "--load", str(tmp_path)])[-1]
    assert_close_lists(resumed["losses"], uninterrupted["losses"][2:])
    assert_close_lists(resumed["grad_norms"], uninterrupted["grad_norms"][2:])


UNIFORM = ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")


@pytest.mark.parametrize("comm,recompute,like", [("p2p", (), ()), ("a2a", ("--recompute-activations",), None),
                                                 ("all_gather", UNIFORM, None), ("p2p", BLOCK, UNIFORM)])
def test_the_stages_cp_theories_add_up_to_the_whole_models(comm, recompute, like):
    """Each pipeline rank's CP bytes are its own layers' (recomputation's rule per model chunk): the 2 ranks of
    interleaved v 2 (chunks of one layer) add up to the whole model's, and block 1, which replays the first layer
    of each chunk, to the whole model's uniform 1 (every layer replayed)."""
    def config(*flags):
        return run_config(parse_args(BASE + ["--context-parallel-size", "2", "--cp-comm-type", comm, *flags]), 4)
    run = config("--pipeline-model-parallel-size", "2", *VIRTUAL, *recompute)
    stages = stage_layers(run.pipeline, 4)
    assert [[len(chunk) for chunk in stage.chunks] for stage in stages] == [[1, 1], [1, 1]]
    whole = config(*(recompute if like is None else like)).model
    total = sum(cp_comm_theory(run.model, 1, 2, 16, 4, 4, stage)[0] for stage in stages)
    assert total == cp_comm_theory(whole, 1, 2, 16, 4, 4)[0] > 0


A2A_INTERLEAVED = ["--cp-comm-type", "a2a", "--attention-backend", "local",  # not SDPA's math path on meta
                   "--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "8"]


@pytest.mark.parametrize("rank,extra", [(13, ["--tensor-model-parallel-size", "2"]), (1, A2A_INTERLEAVED)])
def test_dry_run_of_a_cp_pp_rank_equals_the_planner(rank, extra):
    argv = TINY + ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "32",
                   "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "1", "--zero-stage", "1",
                   "--context-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--dry-run",
                   "--world-size", "16", "--rank", str(rank), *extra]
    _, stdout = main_capturing_stdout(argv)
    planner = [line for line in stdout.splitlines() if line.startswith("planner |")][0]
    assert "CP bytes/iter" in planner and "pipeline bytes/iter" in planner and planner.endswith("| equal"), planner


def test_planner_lays_out_cp_with_pp():
    args = parse_args(TINY + ["--num-layers", "4", "--global-batch-size", "8"])
    planner = Planner(planner_sections(args, 300), Machine(8, 2 ** 30, cuda=False))
    layouts = planner.layouts(stages=(1,), tiers=("none",), recompute=("none",), micro_batches=(1,), cps=(1, 2),
                              pps=(1, 2), tps=(1,), virtual=(), zero_bubble=(False,))
    assert {(lay.cp, lay.pp, lay.dp) for lay in layouts} == {(1, 1, 8), (2, 1, 4), (1, 2, 4), (2, 2, 2)}
    plans = {(lay.cp, lay.pp): planner.evaluate(lay) for lay in layouts}
    both = plans[2, 2]
    assert both.cp_comm > 0 and both.to_json()["layout"]["cp"] == 2 and both.to_json()["layout"]["pp"] == 2
    # stage 0 sends 4 micro-batches' [1, 16/CP, 32] fp32 hidden states, and the tied embedding's ZeRO slice (its
    # 384 x 32 fp32 over DP x CP = 4 ranks) is all-reduced with the last stage's
    assert both.pp_rank == 0 and both.pp_comm == 4 * (1 * 8 * 32 * 4) + 384 * 32 * 4 / 4
