"""Where this rank's share of the training state sits inside the layout-independent tensors a checkpoint stores.

A checkpoint keys every tensor by parameter name and stores it at its global shape: unsharded across TP,
vocabulary padding cropped. Each rank writes exactly the elements its ZeRO partition owns (a contiguous run of
each parameter's flattened TP-local tensor, cut here into at most three rectangles: a partial first row, whole
rows, a partial last row), straight from the optimizer's buffers: no gather, no copy. `torch.distributed.
checkpoint` records the rectangles and reshards on load, where each rank reads the rectangles of its new
partition directly into its buffers, so a checkpoint written at one (TP, DP, ZeRO stage) loads at any other.
"""

from __future__ import annotations

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from mpzero.tensor_parallel.placement import TensorPlacement
from mpzero.zero.state import OwnedPiece


def rectangles(start: int, end: int, cols: int) -> list[tuple[tuple[int, int], tuple[int, int], int]]:
    """Elements [start, end) of a flattened [rows, cols] tensor as (offsets, sizes, flat start) rectangles,
    each contiguous in the flat order."""
    out, at = [], start
    while at < end:
        row, col = divmod(at, cols)
        if col or end - at < cols:  # a partial row
            n = min(cols - col, end - at)
            out.append(((row, col), (1, n), at))
        else:  # as many whole rows as fit
            n = (end - at) // cols * cols
            out.append(((row, 0), (n // cols, cols), at))
        at += n
    return out


def chunks(piece: OwnedPiece, key: str, placement: TensorPlacement, tp_rank: int) -> list[tuple]:
    """(global offsets, sizes, tensor view) for the part of `piece` that is real (not vocabulary padding), in
    the global tensor's coordinates. 1-D parameters are handled as one row."""
    if len(piece.shape) > 2:
        raise NotImplementedError(f"{piece.name}: checkpoints handle 1-D and 2-D parameters")
    out = []
    shape = tuple(piece.shape) if len(piece.shape) == 2 else (1, piece.shape.numel())
    for (row, col), (rows, cols), flat in rectangles(piece.start, piece.end, shape[1]):
        view = piece.tensors[key][flat - piece.start:flat - piece.start + rows * cols]
        if placement.partition_dim == 0 and len(piece.shape) == 2:
            row += tp_rank * shape[0]
            real_rows = min(rows, (placement.unpadded_size or row + rows) - row)  # drop vocabulary padding
            if real_rows <= 0:
                continue
            rows, view = real_rows, view[:real_rows * cols]
        elif placement.partition_dim is not None:  # split along the last (or only) dimension
            col += tp_rank * shape[1]
        if len(piece.shape) == 2:
            out.append(((row, col), (rows, cols), view.view(rows, cols)))
        else:
            out.append(((col,), (cols,), view))
    return out


def sharded(local_chunks: list[tuple], global_shape: tuple[int, ...], groups) -> ShardedTensor:
    """This rank's chunks (global offsets, sizes, tensor view) of one global tensor as a ShardedTensor whose
    local shards are the views themselves (DCP writes from them and loads into them); no collective.

    torch requires a ShardedTensor's metadata to tile the whole tensor, but ZeRO's partitions (and stage 0's
    replicas) are known only locally, and DCP plans each rank's save and load from its local shards alone.
    So the rest of the tensor is described as placeholder chunks on another rank; they are never read."""
    rank, device = groups.world.rank, groups.device
    mine = f"rank:{rank}/{device.type}" + (f":{device.index}" if device.type == "cuda" else "")
    elsewhere = f"rank:{(rank + 1) % groups.world.size}/{device.type}" + (":0" if device.type == "cuda" else "")
    shards = [Shard(t, ShardMetadata(list(offsets), list(sizes), mine)) for offsets, sizes, t in local_chunks]
    rest = [ShardMetadata(list(o), list(z), elsewhere)
            for o, z in _complement([(o, z) for o, z, _ in local_chunks], global_shape)]
    meta = ShardedTensorMetadata([s.metadata for s in shards] + rest, torch.Size(global_shape),
                                 TensorProperties(dtype=local_chunks[0][2].dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta)


def _complement(boxes: list[tuple], shape: tuple[int, ...]) -> list[tuple]:
    """Boxes (offsets, sizes) tiling the part of `shape` the given non-overlapping boxes leave uncovered:
    the cells of the grid their edges cut, less the covered cells."""
    cuts = [sorted({0, n} | {o[d] for o, _ in boxes} | {o[d] + z[d] for o, z in boxes}) for d, n in enumerate(shape)]
    cells = [((),())]
    for edges in cuts:
        cells = [(o + (lo,), z + (hi - lo,)) for o, z in cells for lo, hi in zip(edges, edges[1:])]
    covered = [lambda o, _o=bo, _z=bz: all(a <= x < a + n for x, a, n in zip(o, _o, _z)) for bo, bz in boxes]
    return [(o, z) for o, z in cells if not any(inside(o) for inside in covered)]
