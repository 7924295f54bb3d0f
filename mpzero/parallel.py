"""The TP x DP rank grid, built the Megatron way, returned as a value.

world = TP x DP. Tensor-parallel ranks are adjacent (TP=2: [0,1],[2,3],...) so they share a node and
its fast links; data-parallel groups are strided ([0,2,4,6],[1,3,5,7]). Layers and optimizers take the
`ParallelGroups` they need explicitly: there is no module-level state.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mpzero.comm import CommGroup
from mpzero.errors import ConfigError


@dataclass(frozen=True)
class ParallelGroups:
    tp: CommGroup
    dp: CommGroup
    world: CommGroup
    device: torch.device

    @property
    def tp_size(self) -> int:
        return self.tp.size

    @property
    def tp_rank(self) -> int:
        return self.tp.rank

    @property
    def dp_size(self) -> int:
        return self.dp.size

    @property
    def dp_rank(self) -> int:
        return self.dp.rank

    @property
    def is_logging_rank(self) -> bool:
        return self.world.rank == 0


def rank_grid(world_size: int, tp_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(tp_groups, dp_groups) as lists of global ranks; pure, so it is tested without processes."""
    if tp_size < 1 or world_size % tp_size != 0:
        raise ConfigError(f"world size {world_size} is not divisible by --tensor-model-parallel-size "
                          f"{tp_size}: launch a multiple of {tp_size} processes or change the TP size")
    dp_size = world_size // tp_size
    tp_groups = [list(range(d * tp_size, (d + 1) * tp_size)) for d in range(dp_size)]
    dp_groups = [list(range(t, world_size, tp_size)) for t in range(tp_size)]
    return tp_groups, dp_groups


BACKENDS = ("nccl", "gloo")


def default_backend() -> str:
    """NCCL where CUDA is available, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_parallel(tp_size: int = 1, timeout_minutes: float = 10.0, backend: str | None = None) -> ParallelGroups:
    """Join (or create) the default process group and carve it into TP and DP groups.

    Under torchrun the environment names rank and world; as plain `python` a world of one is made,
    so one code path serves 1 and N processes. Collectives fail after `timeout_minutes` instead of
    hanging when a peer is gone. `backend`: "nccl" (ranks compute on their LOCAL_RANK's GPU) or "gloo"
    (ranks compute on the CPU, also on a GPU host); default `default_backend()`. When the default group
    already exists (the caller made it), a `backend` given must be the one it has.
    """
    timeout = timedelta(minutes=timeout_minutes)
    if backend is not None and backend not in BACKENDS:
        raise ConfigError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("backend 'nccl' needs CUDA, and torch sees no GPU here: use backend='gloo'")
    if dist.is_initialized():
        if backend is not None and backend not in dist.get_backend():
            raise ConfigError(f"the process group already exists with backend {dist.get_backend()!r}, not the "
                              f"{backend!r} asked for: drop the backend argument or create the group with it")
    else:
        backend = backend or default_backend()
        # NCCL binds each rank to its GPU before the first communicator exists (and barriers use it)
        device_id = _device_for_backend(backend) if backend == "nccl" else None
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout,
                                    device_id=device_id)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    tp_groups, dp_groups = rank_grid(world_size, tp_size)
    device = _device_for_backend(dist.get_backend())

    def make(groups: list[list[int]]) -> CommGroup:
        mine = None
        for ranks in groups:  # every rank enters every new_group call, in the same order
            pg = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine = CommGroup(pg, tuple(ranks), ranks.index(rank))
        return mine

    tp, dp = make(tp_groups), make(dp_groups)
    world = CommGroup(dist.group.WORLD, tuple(range(world_size)), rank)
    return ParallelGroups(tp=tp, dp=dp, world=world, device=device)


def _device_for_backend(backend: str) -> torch.device:
    """NCCL ranks compute on their local GPU (made current); gloo ranks on the CPU, even on a GPU host."""
    if "nccl" not in backend:  # also "cpu:gloo,cuda:nccl"
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    return device
