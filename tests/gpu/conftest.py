"""Fixtures shared by the CUDA tests (tests/gpu)."""

import pytest
import torch
import torch.distributed as dist

from mpzero.parallel import init_parallel
from tests.gpu.common import BACKEND, DEVICE


@pytest.fixture(scope="module")
def world():
    """One NCCL process group for the module: pretrain_gpt.main runs inside it (as under a notebook)."""
    groups = init_parallel(1)
    assert dist.get_backend() == BACKEND and groups.device.type == DEVICE.type
    yield groups
    dist.destroy_process_group()


@pytest.fixture
def no_tf32():
    """fp32 matmuls in fp32 (the CUDA tests compare with the CPU model at fp32 tolerances)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before
