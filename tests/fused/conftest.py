"""Kernel tests run the Triton kernels on CUDA when there is a GPU, else on CPU under Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET before triton is imported). Without the `triton`
extra the kernel tests skip; the reference and dispatch tests still run."""

import pytest
import torch


@pytest.fixture
def device() -> torch.device:
    """Where kernels run: the GPU if present, else CPU through the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
