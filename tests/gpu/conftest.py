"""Fixtures shared by the CUDA tests (tests/gpu)."""

import pytest
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
