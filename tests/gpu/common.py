"""Shared by the CUDA tests that `make gpu-check` runs (tests/gpu): the skip marker and small run flags.

They skip without CUDA. MPZERO_GPU_TESTS_ON_CPU=1 runs their logic on CPU (gloo, PyTorch implementations),
to check the tests themselves on a machine without a GPU."""

import os

import pytest
import torch

ON_CPU = os.environ.get("MPZERO_GPU_TESTS_ON_CPU") == "1"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() and not ON_CPU, reason="needs a CUDA GPU")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKEND = "nccl" if torch.cuda.is_available() else "gloo"

# A small GPT on mock data (fp32, no dropout unless a test adds it): seconds per run on a GPU.
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--mock-data", "--vocab-size", "1000", "--log-interval", "5",
         "--eval-iters", "1", "--eval-interval", "1000", "--distributed-timeout-minutes", "2"]


def losses_and_grads(model, tokens):
    """The per-token losses of `tokens` [b, s + 1] and every parameter's gradient of their mean, on the CPU."""
    model.zero_grad(set_to_none=True)
    losses = model(tokens[:, :-1], tokens[:, 1:])
    losses.mean().backward()
    return losses.detach().cpu(), {n: p.grad.detach().cpu() for n, p in model.named_parameters()}


def assert_matches_cpu(got: tuple, want: tuple) -> None:
    """(losses, gradients) of the GPU model against the CPU model's: losses within 1e-5 relative (+1e-5 absolute),
    each gradient within 1e-4 relative + 1e-4 x its largest CPU magnitude absolute (the GPU sums in other orders)."""
    import torch
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert got[1].keys() == want[1].keys()
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=1e-4, atol=1e-4 * grad.abs().max().item() + 1e-12,
                                   msg=lambda m, name=name: f"{name}: {m}")
