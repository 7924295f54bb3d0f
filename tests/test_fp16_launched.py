"""fp16's step launched with no host synchronisation (mpzero/zero/device_scaler.py, device_step.py) against the
synchronising one (--sync-every-iteration): the same losses, gradient norms, learning rates and console lines (loss
scale, skipped iterations) bit for bit over a run that overflows, backs off and grows its scale several times, under
a warmup and cosine schedule (a skipped iteration must not advance it), at ZeRO stages 0-3 at DP 2, TP 2 and PP 2;
the same parameters and AdamW moments at the optimizer (AdamW's reference, and the Triton kernel under its CPU
interpreter); and 0 host reads between log lines (tests/host_syncs.py)."""

import re

import pytest
import torch

from mpzero.fused import triton_available
from mpzero.parallel import init_parallel
from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer, settle, settle_values
from tests.cli import TINY, exit_code_and_stderr, main_capturing_stdout
from tests.distributed import run_ranks
from tests.host_syncs import counting
from tests.zero_toy import make_batches, make_model

RUN = TINY + ["--train-iters", "12", "--log-interval", "4", "--eval-iters", "0", "--fp16", "--no-adam-fusion",
              "--initial-loss-scale", "131072", "--hysteresis", "2", "--loss-scale-window", "3",
              "--lr", "3e-3", "--lr-warmup-iters", "4", "--lr-decay-style", "cosine"]
COUNTED = (2, 3, 5, 6, 7, 9, 10, 11)  # not the first (its one-off reports), not a log line's (4, 8, 12)


def _run(argv) -> tuple[dict, list[str], dict[int, int]]:
    """(history, the iteration lines without their timings, host reads per iteration)."""
    import mpzero.training.loop as loop
    starts, forward_backward = [], loop.forward_backward

    def marked(*args, **kwargs):
        starts.append(len(syncs.events))
        return forward_backward(*args, **kwargs)

    loop.forward_backward = marked  # this forked rank's own copy of the module
    with counting() as syncs:
        history, out = main_capturing_stdout(argv)
    bounds = starts + [len(syncs.events)]
    lines = [re.sub(r"elapsed time per iteration \(ms\): \S+ \||\| tokens/s.*", "", line)
             for line in out.splitlines() if " iteration " in line]
    return history, lines, {i + 1: bounds[i + 1] - bounds[i] for i in range(len(starts))}


def _assert_launched_is_synchronising(argv):
    launched = run_ranks(2, _run, argv)
    synchronising = run_ranks(2, _run, argv + ["--sync-every-iteration"])
    for (got, got_lines, syncs), (want, want_lines, _) in zip(launched, synchronising):
        assert [syncs[i] for i in COUNTED] == [0] * len(COUNTED)
        for key in ("losses", "grad_norms", "lrs"):
            assert got[key] == want[key], key  # bit for bit
        assert got_lines == want_lines
    skipped = [norm is None for norm in want["grad_norms"]]
    assert 3 <= sum(skipped) <= 9, want["grad_norms"]  # it overflowed several times and also trained


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_launched_at_dp2_is_the_synchronising_run(stage):
    _assert_launched_is_synchronising(RUN + ["--zero-stage", str(stage)])


@pytest.mark.parametrize("layout", [pytest.param(["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                                                 marks=pytest.mark.product),
                                    ["--pipeline-model-parallel-size", "2"]], ids=["tp2", "pp2"])
def test_fp16_launched_under_model_parallelism_is_the_synchronising_run(layout):
    _assert_launched_is_synchronising(RUN + ["--zero-stage", "1"] + layout)


@pytest.mark.parametrize("scale", [["--loss-scale", "1e30"], ["--initial-loss-scale", "1e30", "--min-loss-scale",
                                                               "1e30"]], ids=["static", "dynamic"])
def test_fp16_stuck_at_the_minimum_scale_stops_at_the_read_before_saving(tmp_path, scale):
    argv = RUN + ["--train-iters", "20", "--save", str(tmp_path / "ckpt"), "--save-interval", "100"] + scale
    code, stderr = run_ranks(1, exit_code_and_stderr, argv)[0]
    assert code == 1 and stderr.count("\n") == 1
    assert "overflowed at the minimum loss scale 1e+30 for 12 iterations in a row (read at iteration 12)" in stderr
    assert not (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").exists()


def test_a_resumed_launched_fp16_run_continues_the_uninterrupted_one(tmp_path):
    """The checkpoint at a read holds the settled scaler and step count: the resumed run is the uninterrupted one."""
    whole = run_ranks(1, _run, RUN)[0][0]
    run_ranks(1, _run, RUN + ["--save", str(tmp_path), "--save-interval", "8", "--exit-interval", "8"])
    resumed = run_ranks(1, _run, RUN + ["--load", str(tmp_path)])[0][0]
    assert resumed["losses"] == whole["losses"][8:] and resumed["grad_norms"] == whole["grad_norms"][8:]
    assert None in whole["grad_norms"][:8] and None in whole["grad_norms"][8:]  # skips before and after the save


def _optimizer_run(stage: int, launched: bool, impl: str = "torch"):
    """This rank's parameters, moments and AdamW step count after 6 fp16 steps that overflow at first."""
    groups = init_parallel(tp_size=1)
    model = make_model().half()
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=stage, bucket_numel=150),
                        AdamConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5, impl=impl),
                        PrecisionConfig("fp16", initial_loss_scale=2.0 ** 14, hysteresis=1, loss_scale_window=2))
    skipped = 0
    for step, batches in enumerate(make_batches(6, 2, groups.dp_size), start=1):
        for m, micro_batch in enumerate(batches):
            tokens, labels = micro_batch[groups.dp_rank]
            opt.backward(model(tokens, labels).float().mean() / 2, last_micro_batch=m == 1)
        lr = 1e-2 / step  # a schedule: a launched step must pick its rate by the skips before it
        if launched:
            opt.launch_step([1e-2 / (step - skipped - k) for k in range(opt.unsettled_steps + 1)])
        else:
            skipped += opt.step(1e-2 / (step - skipped)).skipped
    if launched:
        skipped = settle(opt, [v.item() for v in settle_values(opt)])
    state = {f"{p.name}/{key}": t.clone() for p in opt.owned_pieces() for key, t in p.tensors.items()}
    return state, opt.adam_step(), skipped, opt.loss_scale, lr


@pytest.mark.parametrize("stage,impl", [(0, "torch"), (1, "torch"), (2, "torch"), (3, "torch"),
                                        pytest.param(2, "triton", marks=pytest.mark.skipif(
                                            not triton_available(), reason="triton not installed"))])
def test_the_launched_fp16_step_leaves_the_synchronising_parameters_and_moments(stage, impl):
    for (want, want_step, want_skipped, want_scale, _), (got, step, skipped, scale, _) in zip(
            run_ranks(2, _optimizer_run, stage, False, impl), run_ranks(2, _optimizer_run, stage, True, impl)):
        assert (step, skipped, scale) == (want_step, want_skipped, want_scale) and 1 <= skipped < 6
        for key in want:
            assert torch.equal(got[key], want[key]), key
