"""GPT forward and backward on CUDA equal the CPU model's (fp32, same weights and tokens).

Tolerance: per-token losses within 1e-5 relative (+1e-5 absolute); every parameter gradient within 1e-4
relative + 1e-4 x its largest CPU magnitude absolute (TF32 off; the GPU sums in other orders: cuBLAS splits,
the Triton kernels' per-program partials). Also: activation recomputation on CUDA replays the dropout masks
(the RNG states are the CUDA generator's), so it gives the same gradients as storing activations.
"""

import dataclasses

import pytest
import torch

from mpzero.comm import CommGroup
from mpzero.models import GPTConfig, GPTModel
from mpzero.tensor_parallel import seed_everything
from tests.gpu.common import DEVICE, needs_cuda

pytestmark = needs_cuda

CONFIG = GPTConfig(num_layers=2, hidden_size=128, num_attention_heads=4, vocab_size=1000,
                   max_position_embeddings=128, hidden_dropout=0.0, attention_dropout=0.0)


@pytest.fixture(autouse=True)
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _one_rank() -> CommGroup:
    return CommGroup(None, (0,), 0)  # size 1: every TP collective is the identity


def _losses_and_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    losses = model(tokens[:, :-1], tokens[:, 1:])
    losses.mean().backward()
    return losses.detach().cpu(), {n: p.grad.detach().cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("variant", ["fused", "torch", "flash"])
def test_gpt_on_cuda_equals_cpu(variant):
    config = dataclasses.replace(CONFIG, use_flash_attn=variant == "flash",
                                 layernorm_impl="torch" if variant == "torch" else "auto",
                                 softmax_impl="torch" if variant == "torch" else "auto")
    cpu = GPTModel(dataclasses.replace(config, layernorm_impl="torch", softmax_impl="torch"), _one_rank(),
                   seed_everything(5, 0, torch.device("cpu")))
    gpu = GPTModel(config, _one_rank(), seed_everything(5, 0, DEVICE), device=DEVICE)
    gpu.load_state_dict(cpu.state_dict())
    tokens = torch.randint(0, config.vocab_size, (4, 129), generator=torch.Generator().manual_seed(0))
    cpu_losses, cpu_grads = _losses_and_grads(cpu, tokens)
    gpu_losses, gpu_grads = _losses_and_grads(gpu, tokens.to(DEVICE))
    torch.testing.assert_close(gpu_losses, cpu_losses, rtol=1e-5, atol=1e-5)
    assert gpu_grads.keys() == cpu_grads.keys()
    for name, want in cpu_grads.items():
        torch.testing.assert_close(gpu_grads[name], want, rtol=1e-4, atol=1e-4 * want.abs().max().item() + 1e-12,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_recompute_on_cuda_replays_dropout_masks():
    config = dataclasses.replace(CONFIG, hidden_dropout=0.1, attention_dropout=0.1)
    trackers = [seed_everything(9, 0, DEVICE) for _ in range(2)]
    stored = GPTModel(config, _one_rank(), trackers[0], device=DEVICE)
    recomputed = GPTModel(dataclasses.replace(config, recompute_activations=True), _one_rank(), trackers[1],
                          device=DEVICE)
    recomputed.load_state_dict(stored.state_dict())
    tokens = torch.randint(0, config.vocab_size, (4, 129), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    start = trackers[0].snapshot()
    results = []
    for model, tracker in zip((stored, recomputed), trackers):
        tracker.restore(start)  # the same default (CUDA) generator and tensor-parallel stream for both
        results.append(_losses_and_grads(model, tokens))
    (losses_a, grads_a), (losses_b, grads_b) = results
    assert torch.equal(losses_a, losses_b)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-6, atol=1e-7)
    dropped = stored(tokens[:, :-1], tokens[:, 1:]).detach()
    stored.eval()
    assert not torch.equal(dropped, stored(tokens[:, :-1], tokens[:, 1:]).detach())  # dropout was on
