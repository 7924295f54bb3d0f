"""Where one rank's tensor sits inside the layout-independent global tensor a checkpoint stores.

A checkpoint keys every tensor by parameter name and stores it at its global shape: unsharded across
TP, vocabulary padding cropped. Each tensor is written as a ShardedTensor whose chunks come from DP rank
0 of each TP rank (DP ranks hold equal copies), and for TP-replicated tensors from TP rank 0 alone, so
every element is written once. `torch.distributed.checkpoint` reshards on load: a checkpoint written at
one (TP, DP, ZeRO stage) reads back at any other. Loading requests the same chunks under the new layout,
then broadcasts over TP (replicated tensors) and DP (every tensor) to the ranks that did not read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from mpzero.parallel import ParallelGroups


@dataclass(frozen=True)
class TensorPlacement:
    """A parameter's TP layout: its TP-local shape, split dimension (None: replicated) and real extent."""
    local_shape: tuple[int, ...]
    partition_dim: int | None
    unpadded_size: int | None

    def global_shape(self, tp_size: int) -> tuple[int, ...]:
        shape = list(self.local_shape)
        if self.partition_dim is not None:
            shape[self.partition_dim] = self.unpadded_size or shape[self.partition_dim] * tp_size
        return tuple(shape)

    def chunk(self, tp_rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, sizes) in the global tensor of TP rank `tp_rank`'s real elements (size 0: padding only)."""
        offsets, sizes = [0] * len(self.local_shape), list(self.local_shape)
        if self.partition_dim is not None:
            d, local = self.partition_dim, self.local_shape[self.partition_dim]
            offsets[d] = tp_rank * local
            end = min(offsets[d] + local, self.unpadded_size or offsets[d] + local)
            sizes[d] = max(end - offsets[d], 0)
        return tuple(offsets), tuple(sizes)


def placements(model: torch.nn.Module) -> dict[str, TensorPlacement]:
    return {name: TensorPlacement(tuple(p.shape), p.partition_dim, getattr(p, "unpadded_size", None))
            for name, p in model.named_parameters()}


def sharded(local: torch.Tensor, placement: TensorPlacement, groups: ParallelGroups) -> ShardedTensor:
    """`local` (this rank's TP-local tensor) as its part of the global ShardedTensor; no collective."""
    metas, mine = [], None
    for rank in range(groups.world.size):
        dp_rank, tp_rank = divmod(rank, groups.tp_size)  # TP ranks adjacent: rank = dp_rank * tp + tp_rank
        if dp_rank != 0 or (placement.partition_dim is None and tp_rank != 0):
            continue
        offsets, sizes = placement.chunk(tp_rank)
        if 0 in sizes:
            continue
        meta = ShardMetadata(list(offsets), list(sizes), _placement(rank, groups))
        metas.append(meta)
        if rank == groups.world.rank:
            mine = Shard(local[tuple(slice(0, s) for s in sizes)], meta)
    properties = TensorProperties(dtype=local.dtype)
    global_meta = ShardedTensorMetadata(metas, torch.Size(placement.global_shape(groups.tp_size)), properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata([mine] if mine else [], global_meta)


def share_loaded(local: torch.Tensor, placement: TensorPlacement, groups: ParallelGroups) -> None:
    """After a load into `sharded(...)` targets: give every rank the values only some ranks read."""
    if placement.partition_dim is None:
        groups.tp.broadcast(local, 0)
    groups.dp.broadcast(local, 0)


def _placement(rank: int, groups: ParallelGroups) -> str:
    device = groups.device
    if device.type != "cuda":
        return f"rank:{rank}/{device.type}"
    index = device.index if rank == groups.world.rank else rank % torch.cuda.device_count()
    return f"rank:{rank}/cuda:{index}"
