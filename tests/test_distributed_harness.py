"""tests/distributed.py's two ways to start ranks. Fork, under a CPU build of torch. A fork server, under a CUDA or
ROCm build, whose autograd engine refuses to run in a process forked after the test process's first backward: its
ranks run a backward after the test process ran one, and see the test process's environment as it is at the call."""

import os

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks, start_method


def _backward(value: float):
    x = torch.full((3,), value, requires_grad=True)
    (x * x).sum().backward()
    return x.grad.tolist(), os.environ.get("MPZERO_HARNESS_MARK"), dist.get_rank(), dist.get_world_size()


def test_the_start_method_follows_the_torch_build():
    gpu_build = torch.version.cuda is not None or torch.version.hip is not None
    assert start_method() == ("forkserver" if gpu_build else "fork")


def test_fork_server_ranks_run_a_backward_after_the_test_process_ran_one(monkeypatch):
    x = torch.ones(2, requires_grad=True)
    x.sum().backward()  # under a GPU build this starts the engine's device threads in the test process
    monkeypatch.setenv("MPZERO_HARNESS_MARK", "set after the server started")
    results = run_ranks(2, _backward, 2.0, start="forkserver")
    assert results == [([4.0] * 3, "set after the server started", rank, 2) for rank in range(2)]


@pytest.mark.skipif(start_method() != "fork", reason="forked ranks fail after a backward here (a GPU build of torch)")
def test_forked_ranks_inherit_the_environment(monkeypatch):
    monkeypatch.setenv("MPZERO_HARNESS_MARK", "forked")
    assert run_ranks(1, _backward, 1.0, start="fork") == [([2.0] * 3, "forked", 0, 1)]
