"""Implementation choice: `auto` resolution, explicit errors instead of fallbacks, torch.compile paths."""

import pytest
import torch

import mpzero.fused.impl as impl_module
from mpzero.fused.impl import planned_impl, resolve_attention_backend
from mpzero.errors import ConfigError
from mpzero.fused import (adamw_step, layer_norm, layer_norm_reference, resolve_impl, resolved_impls,
                          scaled_masked_softmax, scaled_masked_softmax_reference, triton_available)


def test_auto_resolves_to_the_measured_cpu_choice():
    # The decision recorded in bench/README.md from bench/bench_fused_cpu.py: F.layer_norm is one native
    # kernel, compiled softmax loses at small shapes, torch's fused AdamW is 4.6-6.3x eager; RMSNorm's Triton
    # kernel runs on CPU only under the interpreter, so its reference, as the norm's sum of squares; the cross
    # entropy's reference (see CPU_CHOICE).
    assert resolved_impls("cpu") == {"layer_norm": "torch", "rms_norm": "torch", "scaled_masked_softmax": "torch",
                                     "adamw_step": "torch_fused", "cross_entropy": "torch", "sum_of_squares": "torch"}
    assert resolved_impls(torch.device("cpu")) == resolved_impls("cpu")
    assert resolve_impl("adamw_step", torch.device("cpu"), "compile") == "compile"


def test_auto_on_cuda_resolves_to_the_measured_h100_choice_or_says_to_install_triton():
    # bench/README.md at 5a79686, "On one H100": torch's LayerNorm 0.20 ms against the kernel's 0.58; the Triton softmax
    # 9.0x torch's; the Triton AdamW 1.25 ms against torch's fused 1.64.
    assert planned_impl("layer_norm", "cuda") == resolve_impl("layer_norm", "cuda") == "torch"
    assert planned_impl("adamw_step", "cuda") == planned_impl("scaled_masked_softmax", "cuda") == "triton"
    if triton_available():
        assert resolve_impl("scaled_masked_softmax", "cuda") == "triton"
    else:
        with pytest.raises(ConfigError, match=r"pip install 'mpzero\[triton\]'"):
            resolve_impl("scaled_masked_softmax", "cuda")


def test_attention_backend_auto_is_flash_except_on_a_cpu_with_attention_dropout():
    # mpzero/fused/impl.py: CPU SDPA with dropout takes its math fallback, which the activation formula does not model
    for dropout in (0.0, 0.1):
        assert resolve_attention_backend("auto", "cuda", dropout=dropout) == "flash"
    assert resolve_attention_backend("auto", torch.device("cpu"), dropout=0.0) == "flash"
    assert resolve_attention_backend("auto", torch.device("cpu"), dropout=0.1) == "local"
    for backend in ("flash", "unfused", "local"):
        for dropout in (0.0, 0.1):
            assert (resolve_attention_backend(backend, "cpu", dropout=dropout) == backend
                    == resolve_attention_backend(backend, "cuda", dropout=dropout))
    assert resolve_attention_backend("fused", "cuda", dropout=0.0) == "fused"
    with pytest.raises(ConfigError, match="fused is cuDNN's fused attention and needs CUDA"):
        resolve_attention_backend("fused", "cpu", dropout=0.0)
    with pytest.raises(ConfigError, match="--attention-backend sdpa is not one of auto, flash, fused"):
        resolve_attention_backend("sdpa", "cpu", dropout=0.0)


def test_triton_without_triton_installed_is_an_error(monkeypatch):
    monkeypatch.setattr(impl_module, "triton", None)
    with pytest.raises(ConfigError, match="needs the triton package"):
        resolve_impl("scaled_masked_softmax", "cuda", "triton")


def test_triton_on_cpu_without_the_interpreter_is_an_error(monkeypatch):
    monkeypatch.setattr(impl_module, "INTERPRETED", False)
    if not triton_available():
        monkeypatch.setattr(impl_module, "triton", object())
    with pytest.raises(ConfigError, match="needs CUDA tensors"):
        layer_norm(torch.zeros(2, 4), torch.ones(4), torch.zeros(4), impl="triton")


@pytest.mark.parametrize("op, impl", [("layer_norm", "torch_fused"), ("adamw_step", "apex"), ("gelu", "auto")])
def test_unknown_op_or_impl_is_an_error(op, impl):
    with pytest.raises(ConfigError, match="unknown"):
        resolve_impl(op, "cpu", impl)


@pytest.mark.slow  # three torch.compile compilations: ~10 s warm, up to ~40 s with a cold inductor cache
def test_compile_impls_match_references():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 37, generator=g, requires_grad=True)
    w, b = torch.randn(37, generator=g), torch.randn(37, generator=g)
    # Inductor fuses and reorders the fp32 arithmetic: fp32 tolerance, not bitwise.
    torch.testing.assert_close(layer_norm(x, w, b, impl="compile"), layer_norm_reference(x, w, b, 1e-5),
                               rtol=1e-5, atol=1e-5)
    scores, mask = torch.randn(1, 2, 5, 5, generator=g), torch.rand(1, 1, 5, 5, generator=g) < 0.3
    torch.testing.assert_close(scaled_masked_softmax(scores, 0.5, True, mask, impl="compile"),
                               scaled_masked_softmax_reference(scores, 0.5, True, mask), rtol=1e-5, atol=1e-6)
    params = torch.randn(100, generator=g)
    states = [[params.clone(), torch.zeros(100), torch.zeros(100)] for _ in range(2)]
    for step in (1, 2, 3):  # a new step recompiles once, then runs the dynamic graph
        grad = torch.randn(100, generator=g)
        for state, impl in zip(states, ("compile", "torch")):
            adamw_step(state[0], grad, state[1], state[2], lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8,
                       weight_decay=0.1, step=step, impl=impl)
    for got, want in zip(*states):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
