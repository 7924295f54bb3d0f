"""The optimizer step with no host synchronisation (mpzero/zero/device_step.py) against the synchronising one
(`check_gradients` + `step`) on the toy GPT at DP 2, ZeRO stages 0-3: the same weights and moments bit for bit,
with clipping that bites, in fp32, bf16 and bf16 with --grad-reduce-in-bf16 gradients (cast bucket by bucket), with
torch's fused AdamW (found_inf) and the Triton kernel (under its CPU interpreter); a non-finite gradient leaves the
parameters where the synchronising step stops, and every later launched step changes nothing; none of it reads the
device (0 host synchronisations counted, tests/host_syncs.py)."""

import pytest
import torch

from mpzero.errors import TrainingError
from mpzero.fused import triton_available
from mpzero.parallel import init_parallel
from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer
from tests.distributed import run_ranks
from tests.host_syncs import counting
from tests.zero_toy import make_batches, make_model

STEPS, MICRO = 4, 2


def _train(stage: int, dtype: str, impl: str, on_device: bool, nan_at: int | None = None, grads_bf16=False):
    """(this rank's parameters and optimizer states, host syncs inside the launched steps, the step that stopped)."""
    groups = init_parallel(tp_size=1)
    model = make_model()
    if dtype != "fp32":
        model.to(torch.bfloat16)
    precision = PrecisionConfig(dtype, accumulate_allreduce_grads_in_fp32=False if grads_bf16 else None)
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=stage, bucket_numel=150),
                        AdamConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.05, impl=impl), precision)
    assert opt.steps_on_device
    events, stopped = [], None
    for step, step_batches in enumerate(make_batches(STEPS, MICRO, groups.dp_size), start=1):
        for m, micro_batch in enumerate(step_batches):
            tokens, labels = micro_batch[groups.dp_rank]
            opt.backward(model(tokens, labels).mean() / MICRO, last_micro_batch=m == MICRO - 1)
        if step == nan_at and groups.dp_rank == 0:
            opt.stage.grad_shards[0][0] = float("nan")  # one rank's gradient: the global norm is nan everywhere
        if on_device:
            with counting() as syncs:
                launched = opt.launch_step()
            events += syncs.events
        elif stopped is None:
            try:
                opt.step()
            except TrainingError:
                stopped = step
                opt.zero_grad()
    if on_device and nan_at is not None:
        assert bool(launched.halted)
    elif on_device:
        assert not bool(launched.halted)
    state = {f"{p.name}/{key}": t.clone() for p in opt.owned_pieces() for key, t in p.tensors.items()}
    if stage < 3:  # stage 3 releases the model's parameters between uses: its shards are the masters' rounding
        state.update({f"model/{name}": p.detach().clone() for name, p in model.named_parameters()})
    return state, events, stopped


def _assert_same(stage, dtype, impl, nan_at=None, grads_bf16=False):
    synchronising = run_ranks(2, _train, stage, dtype, impl, False, nan_at, grads_bf16)
    launched = run_ranks(2, _train, stage, dtype, impl, True, nan_at, grads_bf16)
    for (want, _, stopped), (got, events, _) in zip(synchronising, launched):
        assert events == [], events
        assert stopped == nan_at
        assert want.keys() == got.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_launched_step_is_the_synchronising_one_at_every_stage(stage):
    _assert_same(stage, "bf16", "torch_fused")


@pytest.mark.parametrize("dtype,grads_bf16", [("fp32", False), ("bf16", True)])
def test_the_launched_step_in_fp32_and_with_bf16_gradients(dtype, grads_bf16):
    _assert_same(2, dtype, "torch_fused", grads_bf16=grads_bf16)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_non_finite_gradient_leaves_the_parameters_where_the_synchronising_step_stops(stage):
    _assert_same(stage, "bf16", "torch_fused", nan_at=2)


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_the_triton_kernel_reads_the_coefficient_and_the_flag_from_memory():
    _assert_same(1, "bf16", "triton", nan_at=3)


def _steps_on_device():
    groups = init_parallel(tp_size=1)
    opt = ZeroOptimizer(make_model().half(), groups, ZeroConfig(stage=1), AdamConfig(), PrecisionConfig("fp16"))
    reference = ZeroOptimizer(make_model(), groups, ZeroConfig(stage=1), AdamConfig(impl="torch"),
                              PrecisionConfig("bf16"))
    return opt.steps_on_device, reference.steps_on_device


def test_a_step_that_needs_the_host_is_not_launched():
    assert run_ranks(1, _steps_on_device) == [(False, False)]  # loss scaling; the reference arithmetic cannot skip
