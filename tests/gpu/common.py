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
