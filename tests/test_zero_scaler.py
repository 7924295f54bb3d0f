"""fp16 loss scaling: Megatron's dynamic scaler, and an overflow on one rank skipping the step on all."""

import pytest
import torch

from mpzero.parallel import init_parallel
from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer
from mpzero.zero.scaler import DynamicLossScaler
from tests.distributed import run_ranks
from tests.zero_toy import make_batches, make_model


def test_dynamic_loss_scaler_matches_megatron_trajectory():
    scaler = DynamicLossScaler(initial_scale=16.0, min_scale=2.0, window=3, hysteresis=2)
    events = [True, True, True, False, False, False, True, False, True, True, True, True]
    scales = []
    for found_inf in events:
        scaler.update(found_inf)
        scales.append(scaler.scale)
    # hysteresis 2: the first overflow is forgiven; 3 clean steps double and restore hysteresis;
    # a clean step in between does not restore it; never below min_scale.
    assert scales == [16, 8, 4, 4, 4, 8, 8, 8, 4, 2, 2, 2]


INF_STEPS = (1, 2)  # iterations at which rank 1 (only) produces an inf gradient


def _fp16_with_overflow(stage):
    groups = init_parallel(tp_size=1)
    model = make_model().half()
    precision = PrecisionConfig("fp16", initial_loss_scale=2.0 ** 10, hysteresis=2)
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=stage), AdamConfig(lr=1e-2), precision)
    target = model.layers[1].fc1.weight
    stats, unchanged = [], []
    for step, step_batches in enumerate(make_batches(4, 2, groups.dp_size)):
        inject = step in INF_STEPS and groups.dp_rank == 1
        hook = target.register_hook(lambda g: g.index_fill(0, torch.tensor([3]), float("inf"))) if inject else None
        before = (opt.consolidated_state_dict(), _optimizer_state(opt))
        for m, micro_batch in enumerate(step_batches):
            opt.backward(model(*micro_batch[groups.dp_rank]).mean() / 2, last_micro_batch=(m == 1))
        stats.append(opt.step())
        after = (opt.consolidated_state_dict(), _optimizer_state(opt))
        unchanged.append(_same(before, after))
        if hook is not None:
            hook.remove()
    return stats, unchanged


def _optimizer_state(opt) -> tuple[int, dict]:
    """Adam's step and a copy of every master / moment piece this rank owns."""
    pieces = {(p.name, p.start): {k: t.clone() for k, t in p.tensors.items()} for p in opt.owned_pieces()}
    return opt.adam_step(), pieces


def _same(before, after) -> bool:
    (w0, (step0, s0)), (w1, (step1, s1)) = before, after
    same_weights = all(torch.equal(w0[n], w1[n]) for n in w0)
    same_moments = step0 == step1 and all(torch.equal(s0[p][k], s1[p][k]) for p in s0 for k in s0[p])
    return same_weights and same_moments


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_fp16_overflow_skips_step_on_all_ranks(stage):
    for stats, unchanged in run_ranks(2, _fp16_with_overflow, stage):
        assert [s.skipped for s in stats] == [False, True, True, False]
        assert unchanged == [False, True, True, False]  # parameters and moments untouched when skipped
        assert [s.grad_norm is None for s in stats] == [False, True, True, False]
        # The scale each backward used: hysteresis 2 forgives the first overflow, halves at the second.
        assert [s.loss_scale for s in stats] == [1024, 1024, 1024, 512]
