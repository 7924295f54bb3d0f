"""The fused ops inside the model and the optimizer: GPT with the Triton LayerNorm and softmax (on CPU
through Triton's interpreter) equals GPT with the PyTorch references, and the ZeRO optimizer with the
Triton AdamW equals it with torch's AdamW arithmetic. fp32 tolerance 1e-5 relative: kernel and reference
sum in another order (~1e-6 per op), a few ops deep. The model is compared on its loss and gradients,
not on weights after Adam steps: Adam divides by sqrt(v), so a gradient that is zero up to rounding
(the key bias's, softmax is shift-invariant) turns rounding noise into lr-sized steps of either sign.
The optimizer test feeds both AdamWs the same model, where that cannot happen before the weights differ;
weights get an absolute 1e-5 (lr/1000) there."""

import dataclasses

import pytest
import torch

from mpzero.models import GPTConfig, GPTModel
from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import seed_everything
from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer
from tests.distributed import run_ranks
from tests.fused.helpers import needs_triton

CONFIG = GPTConfig(num_layers=2, hidden_size=24, num_attention_heads=4, vocab_size=61, max_position_embeddings=9,
                   hidden_dropout=0.0, attention_dropout=0.0, attention_backend="local")  # the softmax runs there
TOL = dict(rtol=1e-5, atol=1e-6)
WEIGHT_TOL = dict(rtol=1e-5, atol=1e-5)


def _train(layernorm_impl, softmax_impl, adam_impl, stage, steps=3):
    groups = init_parallel(1)
    config = dataclasses.replace(CONFIG, layernorm_impl=layernorm_impl, softmax_impl=softmax_impl)
    model = GPTModel(config, groups.tp, seed_everything(3, 0, groups.device))
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=stage), AdamConfig(lr=1e-2, impl=adam_impl),
                        PrecisionConfig())
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 10), generator=torch.Generator().manual_seed(4))
    losses, norms = [], []
    for _ in range(steps):
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
        opt.backward(loss, last_micro_batch=True)
        norms.append(opt.step().grad_norm)
        losses.append(loss.item())
    return losses, norms, opt.consolidated_state_dict()


def _loss_and_grads(layernorm_impl, softmax_impl):
    groups = init_parallel(1)
    config = dataclasses.replace(CONFIG, layernorm_impl=layernorm_impl, softmax_impl=softmax_impl)
    model = GPTModel(config, groups.tp, seed_everything(3, 0, groups.device))
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 10), generator=torch.Generator().manual_seed(4))
    loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def _without_key_bias(name, tensor):
    """The key bias's gradient is zero analytically (softmax ignores a shift shared by all keys): what autograd
    gives is round-off, and Adam divides it by its own magnitude, so two correct kernels may move those entries
    apart by lr-sized amounts. Compare the rest of the QKV bias (laid out head by head: q, k, v)."""
    if not name.endswith("attention.qkv.bias"):
        return tensor
    head_dim = CONFIG.hidden_size // CONFIG.num_attention_heads
    per_head = tensor.view(CONFIG.num_attention_heads, 3, head_dim)
    return per_head[:, [0, 2]].reshape(-1)


def _assert_same_training(a, b):
    torch.testing.assert_close(torch.tensor(a[0]), torch.tensor(b[0]), **TOL)
    torch.testing.assert_close(torch.tensor(a[1]), torch.tensor(b[1]), **TOL)
    for name, value in b[2].items():
        torch.testing.assert_close(_without_key_bias(name, a[2][name]), _without_key_bias(name, value),
                                   **WEIGHT_TOL, msg=lambda m: f"{name}: {m}")


@needs_triton
def test_gpt_with_triton_layernorm_and_softmax_matches_references():
    (fused_loss, fused_grads), = run_ranks(1, _loss_and_grads, "triton", "triton")
    (loss, grads), = run_ranks(1, _loss_and_grads, "torch", "torch")
    assert fused_loss == pytest.approx(loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, **TOL, msg=lambda m: f"{name}: {m}")


@needs_triton
@pytest.mark.parametrize("stage", [1, 3])
def test_zero_with_triton_adamw_matches_torch_adamw(stage):
    fused = run_ranks(1, _train, "torch", "torch", "triton", stage)[0]
    reference = run_ranks(1, _train, "torch", "torch", "torch", stage)[0]
    _assert_same_training(fused, reference)


def test_zero_with_cpu_fused_adamw_matches_torch_adamw():
    """`auto` on CPU is torch's fused AdamW (measured fastest); it differs from the loop by ~4e-7."""
    _assert_same_training(run_ranks(1, _train, "torch", "torch", "torch_fused", 2)[0],
                          run_ranks(1, _train, "torch", "torch", "torch", 2)[0])
