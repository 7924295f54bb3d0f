"""Pipeline parallelism through the command line (pretrain_gpt.main on forked gloo ranks), dropout off, fp32: every
schedule and composition trains the losses of one process within 1e-5 relative (the same bar as every TP x DP x
ZeRO layout: the stages' sums differ from one process's only in the tied embedding's gradient, whose two halves
each stage sums apart); the initial weights at PP 2 and 4 are one process's bit for bit; a checkpoint moves between
pipeline sizes; every bad pipeline flag is one line. The schedules themselves: test_pipeline_schedules.py."""

import os
import signal
import threading
import time

import pytest
import torch

from mpzero.checkpointing import latest_iteration
from mpzero.checkpointing.consolidated import read_consolidated
from mpzero.inference import check_gpt_weights, gpt_config_from_meta
from mpzero.cli.arguments import parse_args, run_config
from mpzero.training import build_training_state
from pretrain_gpt import _provider
from tests.cli import assert_close_lists, exit_code_and_stderr, quiet_main
from tests.distributed import RanksFailed, run_ranks

BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-3",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data", "--vocab-size", "128",
        "--log-interval", "100", "--eval-iters", "1", "--eval-interval", "2"]
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--no-position-embedding",
         "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]


def pp(size, *more):
    return ["--pipeline-model-parallel-size", str(size), *more]


_REFERENCES = {}


def _reference(argv: list[str], deadline: float = 120) -> dict:
    key = tuple(argv)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_ranks(1, quiet_main, argv, deadline=deadline)[0]
    return _REFERENCES[key]


def _assert_matches_one_process(world: int, argv: list[str], reference_argv: list[str] | None = None,
                                deadline: float = 120) -> None:
    reference = _reference(reference_argv or BASE, deadline)
    histories = run_ranks(world, quiet_main, argv, deadline=deadline)
    for history in histories:  # every stage sees the loss (the last stage's, given to all)
        assert_close_lists(history["losses"], reference["losses"])
        assert_close_lists(history["valid_losses"], reference["valid_losses"])
        assert_close_lists(history["grad_norms"], reference["grad_norms"])


@pytest.mark.parametrize("world,flags", [
    (2, pp(2)),
    (4, pp(4)),
    (2, pp(2, "--num-virtual-stages-per-pipeline-rank", "2")),
    (2, pp(2, "--enable-zero-bubble")),
    (4, pp(2, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-activations")),
    (4, pp(2, "--zero-stage", "2")),
], ids=["pp2", "pp4", "interleaved", "zb-h1", "tp2-sp-selective", "dp2-zero2"])
def test_pipeline_layouts_match_one_process(world, flags):
    _assert_matches_one_process(world, BASE + flags)


@pytest.mark.product
@pytest.mark.parametrize("world,flags", [
    (4, pp(2, "--zero-stage", "0")),
    (4, pp(2, "--zero-stage", "1")),
    (4, pp(4, "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "8")),
    (4, pp(4, "--enable-zero-bubble")),
    (4, pp(2, "--enable-zero-bubble", "--tensor-model-parallel-size", "2", "--sequence-parallel")),
    (2, pp(2, "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1")),
    (4, pp(4, "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1",
           "--num-layers", "4")),
    (4, pp(2, "--zero-stage", "1", "--offload-optimizer", "cpu")),
])
def test_pipeline_compositions_match_one_process(world, flags):
    _assert_matches_one_process(world, BASE + flags)


def test_llama_with_gqa_and_rope_across_stages_matches_one_process():
    _assert_matches_one_process(2, BASE + LLAMA + pp(2, "--enable-zero-bubble"), BASE + LLAMA)


@pytest.mark.product  # two compilations of the layers: minutes on 2 cores
def test_compiled_layers_with_zero_bubble_match_one_process():
    """--torch-compile compiles each layer around the linears whose weight gradients ZB-H1 defers."""
    _assert_matches_one_process(2, BASE + pp(2, "--enable-zero-bubble", "--torch-compile"),
                                BASE + ["--torch-compile"], deadline=400)


def test_bf16_pipeline_matches_one_bf16_process_within_rounding():
    """bf16 activations cross the stages as bf16, as they pass between layers in one process; the tied
    embedding's two gradients are summed in fp32 at the end instead of per micro-batch: within 1e-3."""
    reference = _reference(BASE + ["--bf16"])
    history = run_ranks(2, quiet_main, BASE + ["--bf16"] + pp(2))[-1]
    assert_close_lists(history["losses"], reference["losses"], rel=1e-3)


def _initial_weights(argv):
    import torch.distributed as dist
    run = run_config(parse_args(argv), dist.get_world_size())
    state = build_training_state(run, _provider(run), run.parallel.join())
    weights = state.optimizer.consolidated_state_dict()
    state.optimizer.close()
    return {name: tensor for name, tensor in weights.items()}


def test_initial_weights_at_pp_2_and_4_are_one_processs():
    whole = run_ranks(1, _initial_weights, BASE)[0]
    for size in (2, 4):
        stages = run_ranks(size, _initial_weights, BASE + pp(size))
        merged = {}
        for stage in stages:
            merged.update(stage)
        assert sorted(merged) == sorted(whole)
        assert all(torch.equal(merged[name], whole[name]) for name in whole)
        held = [set(stage) for stage in stages]
        assert "embedding.word_embeddings.weight" in held[0] and "embedding.word_embeddings.weight" in held[-1]
        assert "layers.3.mlp.fc1.weight" in held[-1] and "final_layernorm.weight" in held[-1]


def test_a_checkpoint_moves_between_pipeline_sizes(tmp_path):
    """Saved at TP 2 x PP 2 x DP 2 (ZeRO-1), resumed at PP 1 and PP 4: the uninterrupted run's losses."""
    argv = BASE + ["--train-iters", "4", "--eval-iters", "0"]
    saved = argv + pp(2, "--tensor-model-parallel-size", "2")
    uninterrupted = run_ranks(8, quiet_main, saved)[0]
    run_ranks(8, quiet_main, saved + ["--save", str(tmp_path), "--exit-interval", "2"])
    for world, layout in ((1, []), (4, pp(4))):
        resumed = run_ranks(world, quiet_main, argv + layout + ["--load", str(tmp_path)])[-1]
        assert_close_lists(resumed["losses"], uninterrupted["losses"][2:])


@pytest.mark.parametrize("world,flags,message", [
    (2, pp(2, "--num-layers", "3"), "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
    (2, pp(2, "--num-virtual-stages-per-pipeline-rank", "4"), "holds 2 layers, which do not split into 4 virtual"),
    (4, pp(4, "--decoder-first-pipeline-num-layers", "4"), "leaves virtual stage 1 of the 4 without a transformer"),
    (2, pp(2, "--num-layers-per-virtual-pipeline-stage", "1", "--num-virtual-stages-per-pipeline-rank", "2"),
     "give one of them"),
    (1, ["--num-virtual-stages-per-pipeline-rank", "2"], "need --pipeline-model-parallel-size > 1"),
    (4, pp(4, "--num-virtual-stages-per-pipeline-rank", "1", "--num-layers", "8", "--global-batch-size", "6",
           "--micro-batch-size", "1") + ["--num-virtual-stages-per-pipeline-rank", "2"], "use a multiple of 4"),
    (2, pp(2, "--zero-stage", "3"), "--zero-stage 3 gathers each unit"),
    (2, pp(2, "--enable-zero-bubble", "--zero-stage", "2"), "--zero-stage 2 reduce-scatters"),
    (2, pp(2, "--enable-zero-bubble", "--num-virtual-stages-per-pipeline-rank", "2"), "ZB-H1, one model chunk"),
    (1, ["--enable-zero-bubble"], "needs --pipeline-model-parallel-size > 1"),
    (2, pp(2, "--enable-zero-bubble", "--global-batch-size", "2"), "needs at least --pipeline-model-parallel-size"),
    (3, pp(2), "world size 3 is not divisible by TP 1 x CP 1 x PP 2"),
    (2, pp(2, "--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers", "3"),
     "must add up to --num-layers 4"),
])
def test_every_bad_pipeline_flag_is_one_line(world, flags, message):
    for code, err in run_ranks(world, exit_code_and_stderr, BASE + flags)[:1]:
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def _sigterm_then_train(argv):
    import torch.distributed as dist
    if dist.get_rank() == 1:  # the last stage, which holds the loss
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    return len(quiet_main(argv)["losses"])


def test_sigterm_on_one_stage_saves_every_stage_and_stops(tmp_path):
    argv = BASE + pp(2) + ["--train-iters", "100000", "--eval-iters", "0", "--save", str(tmp_path)]
    stopped_at = run_ranks(2, _sigterm_then_train, argv)
    assert stopped_at[0] == stopped_at[1] == latest_iteration(str(tmp_path)) < 100000


def _die_after(delay, report_dir, argv):
    import torch.distributed as dist
    if dist.get_rank() == 2:  # a middle stage
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    code, stderr = exit_code_and_stderr(argv)
    with open(os.path.join(report_dir, f"rank{dist.get_rank()}.txt"), "w") as f:
        f.write(f"{code}\n{stderr}")


@pytest.mark.product  # 30 s: training past start-up, then the 12 s collective timeout (test_parallel: 3 s)
def test_a_dead_stage_ends_every_other_with_one_line(tmp_path):
    argv = BASE + pp(4) + ["--train-iters", "100000", "--eval-iters", "0", "--distributed-timeout-minutes", "0.2"]
    start = time.monotonic()
    with pytest.raises(RanksFailed, match="rank 2 ---\nprocess died"):  # 6 s: in training, past every start-up
        run_ranks(4, _die_after, 6.0, str(tmp_path), argv, deadline=120)  # collective (they wait on the store)
    assert time.monotonic() - start < 60  # the 12 s collective timeout, not the test's deadline
    for rank in (0, 1, 3):
        code, stderr = (tmp_path / f"rank{rank}.txt").read_text().split("\n", 1)
        assert code == "1" and stderr.startswith("error: a collective failed, a peer rank has died or timed out")
        assert stderr.count("\n") == 1


def test_the_tools_read_a_pipeline_checkpoint_as_one_processs(tmp_path):
    """What export_hf.py and generate.py read (the consolidated weights, checked against the meta's model): a PP 2
    checkpoint holds every parameter once, the tied embedding included, with one process's values."""
    argv = BASE + ["--train-iters", "2", "--eval-iters", "0"]
    run_ranks(1, quiet_main, argv + ["--save", str(tmp_path / "pp1")])
    run_ranks(2, quiet_main, argv + pp(2) + ["--save", str(tmp_path / "pp2")])
    whole, staged = (read_consolidated(str(tmp_path / name), 2) for name in ("pp1", "pp2"))
    config = gpt_config_from_meta(staged["meta"], str(tmp_path / "pp2"))
    check_gpt_weights(staged["model"], config, "pp2")
    assert sorted(staged["model"]) == sorted(whole["model"])
    for name, tensor in whole["model"].items():  # atol: AdamW's step on a gradient near 0 moves by up to lr x its
        # rounding (the tied embedding's two halves are summed in another order), 1e-3 of the 1e-3 learning rate
        torch.testing.assert_close(staged["model"][name], tensor, rtol=1e-5, atol=1e-6)


def test_fp16_skips_the_same_steps_on_every_stage_as_one_process():
    """One loss scale: an overflow on any stage skips the step everywhere (the norm's all-reduce over the world
    carries it), so the skipped iterations and the scale's path are one process's."""
    argv = BASE + ["--fp16", "--initial-loss-scale", "1e6", "--hysteresis", "1", "--train-iters", "6"]
    reference = _reference(argv)
    for history in run_ranks(2, quiet_main, argv + pp(2)):
        assert [n is None for n in history["grad_norms"]] == [n is None for n in reference["grad_norms"]]
        assert any(n is None for n in history["grad_norms"]) and history["grad_norms"][-1] is not None
        assert_close_lists(history["losses"], reference["losses"], rel=1e-3)
