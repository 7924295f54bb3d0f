"""--offload-delayed-update-after N (ZeRO-Offload's DPU, issue 24 item 4) equals, bit for bit, a reference loop
that applies the update one step late: iteration i's gradients are taken at w_{i-1} for i <= N + 1 and at
w_{i-2} after, while the optimizer steps w_i = step(w_{i-1}, g_i) in order (the reference is the same optimizer
without the flag, the model's parameters swapped to w_{i-2} for forward/backward only). The CPU step of iteration
i runs in a background thread during iteration i+1's forward/backward. Bad flags are one line each."""

import math

import pytest
import torch

from mpzero.errors import ConfigError
from mpzero.parallel import init_parallel
from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer
from mpzero.zero.config import OffloadConfig
from tests.cli import TINY, exit_code_and_stderr, main_capturing_stdout
from tests.distributed import run_ranks
from tests.test_offload_cli import _checkpoint_state
from tests.zero_toy import make_batches, make_model

STEPS, MICRO = 6, 2


def _train(stage, dtype, tier, delay_after, reference, path):
    groups = init_parallel(1)
    model = make_model(num_layers=2)
    precision = PrecisionConfig(dtype, initial_loss_scale=2.0 ** 16)  # fp16: the first iterations overflow
    model.to(precision.torch_dtype)
    offload = OffloadConfig(optimizer=tier, sub_group_numel=257, path=path if tier == "disk" else None,
                            delayed_update_after=None if reference else delay_after)
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=stage, bucket_numel=400),
                        AdamConfig(lr=3e-2, clip_grad=0.5), precision, offload=offload)
    params = list(model.parameters())
    losses, previous = [], None
    for i, step_batches in enumerate(make_batches(STEPS, MICRO, groups.dp_size), start=1):
        current = [p.detach().clone() for p in params]  # w_{i-1}, what the model holds now
        stale = reference and i >= delay_after + 2
        if stale:  # the reference: gradients at w_{i-2}
            with torch.no_grad():
                for p, value in zip(params, previous):
                    p.copy_(value)
        total = 0.0
        for m, micro in enumerate(step_batches):
            loss = model(*micro[groups.dp_rank]).mean() / MICRO
            opt.backward(loss, last_micro_batch=m == MICRO - 1)
            total += loss.item()
        if stale:
            with torch.no_grad():
                for p, value in zip(params, current):
                    p.copy_(value)
        stats = opt.step()
        losses.append((total, stats.grad_norm))
        previous = current
    opt.finish_update()
    result = dict(losses=losses, params=[p.detach().clone() for p in params], adam_step=opt.adam_step(),
                  masters=[m.clone() for m in opt.masters.masters()])
    opt.close()
    return result


@pytest.mark.parametrize("stage,dtype,tier,delay_after,dp", [
    (2, "fp32", "cpu", 0, 1), (2, "bf16", "cpu", 2, 1), (1, "bf16", "cpu", 1, 1), (3, "fp32", "cpu", 1, 1),
    (2, "fp16", "cpu", 1, 1), (2, "bf16", "disk", 1, 1), (2, "bf16", "cpu", 1, 2), (1, "fp32", "disk", 0, 2)])
def test_delayed_update_matches_the_one_step_late_reference_loop(stage, dtype, tier, delay_after, dp, tmp_path):
    """Stage 3 at DP 1 only: the reference swaps the model's parameters, which stage 3 shards at DP > 1."""
    delayed = run_ranks(dp, _train, stage, dtype, tier, delay_after, False, str(tmp_path / "a"))[0]
    reference = run_ranks(dp, _train, stage, dtype, tier, delay_after, True, str(tmp_path / "b"))[0]
    assert delayed["losses"] == reference["losses"]
    skipped = sum(norm is None for _, norm in delayed["losses"])
    assert (skipped > 0) == (dtype == "fp16")  # fp16's overflow skip is decided before the update starts: consistent
    assert delayed["adam_step"] == reference["adam_step"] == STEPS - skipped
    for ours, theirs in zip(delayed["params"] + delayed["masters"], reference["params"] + reference["masters"]):
        assert torch.equal(ours, theirs)
    # and it is not the ordinary run: the stale gradients change the trajectory after warm-up
    ordinary = run_ranks(dp, _train, stage, dtype, tier, STEPS + 5, False, str(tmp_path / "c"))[0]
    assert ordinary["losses"][:delay_after + 1] == delayed["losses"][:delay_after + 1]
    assert ordinary["losses"][delay_after + 2:] != delayed["losses"][delay_after + 2:]


@pytest.mark.parametrize("flags,fragment", [
    (["--offload-delayed-update-after", "2"], "needs --offload-optimizer cpu or disk"),
    (["--offload-delayed-update-after", "-1", "--offload-optimizer", "cpu"], "must be >= 0"),
    (["--offload-delayed-update-after", "1.5", "--offload-optimizer", "cpu"], "invalid int value"),
])
def test_bad_delayed_update_flags_are_one_line_errors(flags, fragment):
    code, stderr = exit_code_and_stderr(TINY + ["--zero-stage", "2"] + flags)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], stderr


def test_the_library_refuses_a_delay_without_an_offloaded_optimizer():
    with pytest.raises(ConfigError, match="needs --offload-optimizer cpu or disk"):
        OffloadConfig(delayed_update_after=0).validate(2)


@pytest.mark.parametrize("tiers", [["--zero-stage", "2", "--offload-optimizer", "cpu"],
                                   ["--zero-stage", "3", "--offload-optimizer", "disk", "--offload-params", "disk"]])
def test_delayed_update_through_pretrain_gpt_saves_evaluates_and_resumes(tmp_path, tiers):
    """Through the training loop at DP 2: the first N + 1 iterations are the ordinary run's; an evaluation (every
    5 iterations) and the checkpoint apply the pending update first; the run resumes from its checkpoint. Stage 3
    with parameters on disk: the deferred values reach the parameter tier when the update is applied."""
    if "disk" in tiers:
        tiers = tiers + ["--offload-path", str(tmp_path / "swap")]
    argv = TINY + ["--bf16"] + tiers + ["--save", str(tmp_path / "ckpt")]
    ordinary, _ = run_ranks(2, main_capturing_stdout, argv[:-2] + ["--save", str(tmp_path / "plain")])[0]
    delayed, stdout = run_ranks(2, main_capturing_stdout, argv + ["--offload-delayed-update-after", "3"])[0]
    assert delayed["losses"][:4] == ordinary["losses"][:4]
    assert delayed["losses"][5:] != ordinary["losses"][5:] and all(map(math.isfinite, delayed["losses"]))
    assert len(delayed["valid_losses"]) == 3 and all(map(math.isfinite, delayed["valid_losses"]))
    meta, _ = _checkpoint_state(str(tmp_path / "ckpt"))
    assert meta["step"] == 10  # the last update was applied before the save
    resumed, _ = run_ranks(2, main_capturing_stdout, argv + ["--offload-delayed-update-after", "0", "--load",
                                                             str(tmp_path / "ckpt"), "--train-iters", "12"])[0]
    assert len(resumed["losses"]) == 2 and all(map(math.isfinite, resumed["losses"]))
