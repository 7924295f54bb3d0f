"""ZeRO stages 0-3 against torch's single-process AdamW on the toy GPT (tests/zero_toy.py)."""

import pytest
import torch

from mpzero.parallel import init_parallel
from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer
from tests.distributed import run_ranks
from tests.zero_toy import make_batches, make_model, reference_adamw, reference_grads

STEPS, MICRO, LR, WD = 3, 2, 1e-2, 0.1


def _train(stage, steps, micro, overlap=True, recompute=False, dtype="fp32", bucket=150, clip=0.0):
    """Runs on every rank: returns (this rank's consolidated fp32 weights, grad norms)."""
    groups = init_parallel(tp_size=1)
    model = make_model(recompute=recompute)
    if dtype != "fp32":
        model.to(PrecisionConfig(dtype).torch_dtype)
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=stage, bucket_numel=bucket, overlap_comm=overlap),
                        AdamConfig(lr=LR, weight_decay=WD, clip_grad=clip, impl="torch"),
                        PrecisionConfig(dtype, initial_loss_scale=2.0 ** 12))  # no fp16 overflow here
    batches = make_batches(steps, micro, groups.dp_size)
    norms = []
    for step_batches in batches:
        for m, micro_batch in enumerate(step_batches):
            tokens, labels = micro_batch[groups.dp_rank]
            opt.backward(model(tokens, labels).mean() / micro, last_micro_batch=(m == micro - 1))
        norms.append(opt.step().grad_norm)
    return opt.consolidated_state_dict(), norms


def _reference(dp_size, steps, micro, stage, clip=0.0):
    model = make_model()
    opt = reference_adamw(model, LR, WD)
    norms = []
    for step_batches in make_batches(steps, micro, dp_size):
        reference_grads(model, step_batches, dp_size, per_micro_batch=stage >= 2)
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item()
        if clip and norm > clip:
            for g in grads:
                g.mul_(clip / (norm + 1e-6))
        norms.append(norm)
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}, norms


@pytest.mark.parametrize("dp_size", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_matches_torch_adamw(stage, dp_size):
    results = run_ranks(dp_size, _train, stage, STEPS, MICRO)
    expected, expected_norms = _reference(dp_size, STEPS, MICRO, stage)
    for weights, norms in results:
        assert weights.keys() == expected.keys()
        for name, value in expected.items():
            if dp_size == 2:  # exact: same gradients (a + b commutes), same elementwise AdamW
                assert torch.equal(weights[name], value), name
            else:  # gloo's ring adds 4 ranks' gradients in another order than the reference: ~1 ulp
                torch.testing.assert_close(weights[name], value, rtol=1e-6, atol=1e-6)
        # The norm is summed in a different order (per shard, then across ranks): fp32 rounding.
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(expected_norms), rtol=1e-6, atol=0)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_without_overlap_or_with_recompute_matches_torch_adamw(stage):
    expected, _ = _reference(2, STEPS, MICRO, stage)
    for kwargs in ({"overlap": False}, {"recompute": True}, {"bucket": 10**9}):
        for weights, _ in run_ranks(2, _train, stage, STEPS, MICRO, **kwargs):
            for name, value in expected.items():
                assert torch.equal(weights[name], value), (name, kwargs)


def test_zero_clipping_matches_torch_adamw():
    expected, expected_norms = _reference(2, STEPS, MICRO, 2, clip=0.05)
    assert max(expected_norms) > 0.05  # clipping is active
    for weights, norms in run_ranks(2, _train, 2, STEPS, MICRO, clip=0.05):
        # The clip coefficient comes from a norm summed in another order: ~1e-7 relative per step.
        for name, value in expected.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_zero_mixed_precision_stages_match_stage0(dtype):
    """Mixed precision: stage 1 does stage 0's arithmetic and stage 3 stage 2's, bit for bit; stages
    2-3 sum gradients per micro-batch, so against stage 0 they may differ by rounding (2 ulps of the
    parameter dtype after a few steps)."""
    runs = {stage: run_ranks(2, _train, stage, STEPS, MICRO, dtype=dtype) for stage in range(4)}
    for stage, same_as in ((1, 0), (3, 2), (2, 0)):
        for (weights, norms), (base, base_norms) in zip(runs[stage], runs[same_as]):
            exact = same_as == stage - 1
            # Norms add squares per slice (fp32 rounding, 1e-6); fp16 gradients summed in another
            # order round differently (fp16's eps is ~1e-3).
            assert None not in norms and norms == pytest.approx(base_norms, rel=1e-6 if exact else 1e-3)
            for name, value in base.items():
                if exact:
                    assert torch.equal(weights[name], value), (stage, name)
                else:
                    torch.testing.assert_close(weights[name], value, rtol=2 ** -6, atol=1e-3)


def _gathered_during_forward(prefetch, recompute):
    """Which layers hold gathered parameters while each layer runs forward (and after the step)."""
    groups = init_parallel(tp_size=1)
    model = make_model(num_layers=4, recompute=recompute)
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=3, prefetch=prefetch), AdamConfig(), PrecisionConfig())
    seen = []

    def record(module, args):
        if not torch.is_grad_enabled() or not recompute:  # the first forward, not the recomputation
            seen.append([layer.fc1.weight.untyped_storage().nbytes() > 0 for layer in model.layers])
    for layer in model.layers:
        layer.register_forward_pre_hook(record)
    for step_batches in make_batches(2, 1, groups.dp_size):
        opt.backward(model(*step_batches[0][groups.dp_rank]).mean(), last_micro_batch=True)
        opt.step()
    at_rest = [p.untyped_storage().nbytes() for p in model.parameters() if p.requires_grad]
    return seen, at_rest


@pytest.mark.parametrize("recompute", [False, True])
def test_zero_stage3_gathers_one_unit_ahead_and_releases(recompute):
    for prefetch, ahead in ((False, 0), (True, 1)):
        for seen, at_rest in run_ranks(2, _gathered_during_forward, prefetch, recompute):
            # The second iteration knows the unit order: layer i runs with i+1 prefetched (if asked).
            expected = [[j in range(i, i + 1 + ahead) for j in range(4)] for i in range(4)]
            assert seen[4:] == expected, prefetch
            assert not any(at_rest)  # between iterations only the 1/N slices exist


@pytest.mark.parametrize("section, fragment", [(ZeroConfig(stage=4), "--zero-stage 4"),
                                               (AdamConfig(beta2=1.0), "--adam-beta2"),
                                               (PrecisionConfig("fp8"), "fp8"),
                                               (PrecisionConfig("fp16", hysteresis=0), "--hysteresis")])
def test_zero_config_rejects_bad_values_in_one_line(section, fragment):
    from mpzero.errors import ConfigError
    with pytest.raises(ConfigError, match=fragment) as error:
        section.validate()
    assert "\n" not in str(error.value)


def _step_too_early():
    groups = init_parallel(tp_size=1)
    model = make_model()
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=1), AdamConfig(), PrecisionConfig())
    tokens, labels = make_batches(1, 1, groups.dp_size)[0][0][groups.dp_rank]
    opt.backward(model(tokens, labels).mean(), last_micro_batch=False)
    with pytest.raises(RuntimeError, match="last_micro_batch=True"):
        opt.step()
    return True


def test_zero_step_before_last_micro_batch_is_refused():
    assert run_ranks(2, _step_too_early) == [True, True]


def _check_then_step():
    groups = init_parallel(tp_size=1)
    model = make_model()
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=2), AdamConfig(lr=LR, impl="torch"), PrecisionConfig("fp32"))
    tokens, labels = make_batches(1, 1, groups.dp_size)[0][0][groups.dp_rank]
    loss = model(tokens, labels).mean()
    opt.backward(loss, last_micro_batch=True)
    check = opt.check_gradients(read_with=(loss.detach(), torch.full((), 3.0)))
    with pytest.raises(RuntimeError, match="once per step"):
        opt.check_gradients()
    return check, loss.item(), opt.step().grad_norm


def test_zero_check_gradients_reads_the_callers_scalars_with_the_norm_the_step_uses():
    for check, loss, norm in run_ranks(2, _check_then_step):
        assert check.read_with == (loss, 3.0) and check.norm == norm > 0
