"""AdamW over a flat fp32 partition: every implementation against torch.optim.AdamW."""

import pytest
import torch

from mpzero.errors import ConfigError
from mpzero.fused import adamw_step
from tests.fused.helpers import needs_triton

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
N = 3 * 1024 + 7  # a partial last block


def _run_torch_adamw(p0, grads, fused):
    """torch.optim.AdamW over the same steps, pinned to one implementation."""
    param = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"], foreach=False, fused=fused)
    for g in grads:
        param.grad = g.float()
        opt.step()
    return param.detach(), opt.state[param]["exp_avg"], opt.state[param]["exp_avg_sq"]


def _run_adamw_step(p0, grads, impl, device="cpu", copy_dtype=None, grad_scale=1.0):
    params = p0.clone().to(device)
    exp_avg, exp_avg_sq = torch.zeros_like(params), torch.zeros_like(params)
    copy = None if copy_dtype is None else torch.empty(params.shape, dtype=copy_dtype, device=device)
    for step, g in enumerate(grads, start=1):
        adamw_step(params, g.to(device), exp_avg, exp_avg_sq, step=step, model_copy=copy, impl=impl,
                   grad_scale=grad_scale, **HYPER)
    return params.cpu(), exp_avg.cpu(), exp_avg_sq.cpu(), copy


def _data(grad_dtype):
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, generator=g), [torch.randn(N, generator=g).to(grad_dtype) for _ in range(3)]


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_adamw_reference_matches_torch_adamw(grad_dtype):
    p0, grads = _data(grad_dtype)
    expected = _run_torch_adamw(p0, grads, fused=False)
    for got, want in zip(_run_adamw_step(p0, grads, "torch"), expected):
        assert torch.equal(got, want)  # the same ops on the same fp32 data: bit for bit


def test_adamw_torch_fused_matches_torch_fused_adamw():
    p0, grads = _data(torch.float16)
    expected = _run_torch_adamw(p0, grads, fused=True)
    for got, want in zip(_run_adamw_step(p0, grads, "torch_fused"), expected):
        assert torch.equal(got, want)  # torch's own fused kernel, called through its functional API


@needs_triton
@pytest.mark.parametrize("grad_dtype, copy_dtype", [(torch.float32, None), (torch.float32, torch.bfloat16),
                                                    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)],
                         ids=str)
def test_adamw_triton_matches_reference(grad_dtype, copy_dtype, device):
    p0, grads = _data(grad_dtype)
    params, exp_avg, exp_avg_sq, copy = _run_adamw_step(p0, grads, "triton", device, copy_dtype)
    expected = _run_adamw_step(p0, grads, "torch", copy_dtype=copy_dtype)
    # Same formula in fp32 with IEEE sqrt/div; the kernel multiplies and adds in another order
    # (and may contract to FMA on a GPU): a few fp32 ulps after three steps.
    for got, want in zip((params, exp_avg, exp_avg_sq), expected[:3]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    if copy_dtype is not None:
        # The copy is the new fp32 params rounded once: one ulp (the interpreter truncates bf16 stores).
        torch.testing.assert_close(copy.cpu(), params.to(copy_dtype), rtol=torch.finfo(copy_dtype).eps, atol=0)


SCALE = 0.37  # a clipping coefficient


@needs_triton
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_adamw_triton_folds_the_gradient_scale_into_its_pass(grad_dtype, device):
    """Clipping inside the kernel is the kernel on clipped gradients (the same fp32 multiply; on a GPU it may
    contract into an FMA with what follows: a few ulps), and the gradients are not written."""
    p0, grads = _data(grad_dtype)
    on_device = [g.to(device) for g in grads]
    kept = [g.clone() for g in on_device]
    folded = _run_adamw_step(p0, on_device, "triton", device, grad_scale=SCALE)[:3]
    clipped = _run_adamw_step(p0, [g.float() * SCALE for g in kept], "triton", device)[:3]
    assert all(torch.equal(g, k) for g, k in zip(on_device, kept))
    for got, want in zip(folded, clipped):
        if device.type == "cpu":
            assert torch.equal(got, want)  # the interpreter multiplies as torch's mul_ does
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_the_other_implementations_scale_fp32_gradients_in_place_first():
    p0, grads = _data(torch.float32)
    for impl in ("torch", "torch_fused"):
        scaled = [g.clone() for g in grads]
        got = _run_adamw_step(p0, scaled, impl, grad_scale=SCALE)[:3]
        want = _run_adamw_step(p0, [g * SCALE for g in grads], impl)[:3]
        assert all(torch.equal(s, g * SCALE) for s, g in zip(scaled, grads))  # in place, as clipping does
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@needs_triton
def test_device_masters_clip_in_the_triton_step_and_elsewhere_first(device):
    """The store folds the clipping coefficient into AdamW's Triton kernel (no pass over the gradients) and scales
    them in place before any other implementation's step; the masters are those of clipping first."""
    from torch import nn

    from mpzero.zero.config import AdamConfig
    from mpzero.zero.flat import bucket_layouts, initial_values, mark_weight_decay
    from mpzero.zero.masters import DeviceMasters
    gen = torch.Generator().manual_seed(1)
    named = [(name, nn.Parameter(torch.randn(*shape, generator=gen)))
             for name, shape in {"w": (37, 29), "b": (29,), "w2": (300, 7)}.items()]
    mark_weight_decay(named)
    layouts = bucket_layouts(named, 1500, 1, 0)
    initial = [initial_values(layout, device) for layout in layouts]

    def store(impl):
        return DeviceMasters(layouts, [v.clone() for v in initial], [v.clone() for v in initial],
                             AdamConfig(weight_decay=0.1, impl=impl))
    grads = [torch.randn(layout.shard_numel, generator=gen).to(device) for layout in layouts]
    kept = [g.clone() for g in grads]
    folded, clipped, reference = store("triton"), store("triton"), store("torch")
    folded.step(grads, 1e-2, grad_scale=SCALE)
    assert all(torch.equal(g, k) for g, k in zip(grads, kept))  # no pass over the gradients
    clipped.step([k * SCALE for k in kept], 1e-2)
    for got, want in zip(folded.masters(), clipped.masters()):
        torch.testing.assert_close(got, want, rtol=0 if device.type == "cpu" else 1e-6, atol=0 if
                                   device.type == "cpu" else 1e-7)
    reference.step(grads, 1e-2, grad_scale=SCALE)
    assert all(torch.equal(g, k * SCALE) for g, k in zip(grads, kept))  # scaled first, in place


def test_adamw_step_rejects_a_non_flat_partition():
    params = torch.zeros(4, 4)
    with pytest.raises(ConfigError, match="params must be a flat contiguous fp32 tensor"):
        adamw_step(params, params, params, params, step=1, impl="torch", **HYPER)
    flat = torch.zeros(8)
    with pytest.raises(ConfigError, match="step counts from 1"):
        adamw_step(flat, flat, flat.clone(), flat.clone(), step=0, impl="torch", **HYPER)


def test_adamw_step_rejects_tensors_on_another_device():
    flat = torch.zeros(8)
    with pytest.raises(ConfigError, match="exp_avg_sq is on meta but params on cpu"):
        adamw_step(flat, flat.clone(), flat.clone(), flat.to("meta"), step=1, impl="torch", **HYPER)


@pytest.mark.parametrize("impl", ["torch_fused", pytest.param("triton", marks=needs_triton)])
def test_a_device_coefficient_and_skip_flag_step_as_the_host_values_do(impl, device):
    """The step with no host synchronisation (issue 46): the clipping coefficient as a 0-dim fp32 device tensor gives
    the host float's result bit for bit (both are that float rounded to fp32), an unset flag changes nothing, and a
    set one leaves the partition, its moments and the model copy exactly as they were."""
    if impl == "torch_fused" and device.type != "cpu":
        pytest.skip("torch_fused's device path is the CPU's here; the GPU's is triton (make gpu-check)")
    p0, grads = _data(torch.float32)
    coef = torch.tensor(SCALE, dtype=torch.float64).float().to(device)
    host = _run_adamw_step(p0, [g.clone() for g in grads], impl, device, torch.bfloat16, grad_scale=SCALE)
    for flag in (False, True):
        params = p0.clone().to(device)
        exp_avg, exp_avg_sq = torch.zeros(N, device=device), torch.zeros(N, device=device)
        copy = torch.full((N,), 7.0, dtype=torch.bfloat16, device=device)
        skip = torch.full((), flag, dtype=torch.bool, device=device)
        for step, g in enumerate(grads, start=1):
            adamw_step(params, g.clone().to(device), exp_avg, exp_avg_sq, step=step, model_copy=copy, impl=impl,
                       grad_scale=coef, skip=skip, **HYPER)
        got = (params.cpu(), exp_avg.cpu(), exp_avg_sq.cpu(), copy.cpu())
        if flag:
            assert torch.equal(got[0], p0) and not got[1].any() and not got[2].any()
            assert torch.equal(got[3], torch.full((N,), 7.0, dtype=torch.bfloat16)) or impl == "torch_fused"
        else:
            assert all(torch.equal(a, b.cpu()) for a, b in zip(got, host))


def test_the_reference_cannot_skip_on_a_device_flag():
    flat = torch.zeros(8)
    with pytest.raises(ConfigError, match="cannot skip on a device flag"):
        adamw_step(flat, flat.clone(), flat.clone(), flat.clone(), step=1, impl="torch",
                   skip=torch.zeros((), dtype=torch.bool), **HYPER)
