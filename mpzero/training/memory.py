"""Peak memory of every rank, gathered for logging: CUDA's peak allocation on GPUs, the process's peak
resident set on CPU."""

from __future__ import annotations

import resource

import torch

from mpzero.parallel import ParallelGroups


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def memory_per_rank(groups: ParallelGroups) -> list[int]:
    """Every rank's peak, in world-rank order; a collective, so every rank must call it."""
    return groups.world.all_gather_objects(peak_memory_bytes(groups.device))
