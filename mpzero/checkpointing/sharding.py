"""Where this rank's share of the training state sits inside the layout-independent tensors a checkpoint stores,
and the `torch.distributed.checkpoint` planners that write and read exactly that share.

A checkpoint keys every tensor by parameter name and stores it at its global shape: unsharded across TP,
vocabulary padding cropped. Each rank writes exactly the elements its ZeRO partition owns (a contiguous run of
each parameter's flattened TP-local tensor, cut here into at most three rectangles: a partial first row, whole
rows, a partial last row), straight from the optimizer's buffers: no gather. DCP records the rectangles as the
stored tensor's chunks and reshards on load, where each rank reads the rectangles of its new partition
directly into its buffers, so a checkpoint written at one (TP, DP, ZeRO stage) loads at any other.

The planners work on the public planner API alone: a rank's local save plan is one SHARD `WriteItem` per
rectangle (DCP's global plan keeps one copy of rectangles several ranks hold, stage 0's DP replicas), and its
local load plan is `create_read_items_for_chunk_list` over its rectangles against the stored chunks.

Checksums (format 3, checksums.py): the save planner records a checksum of every chunk DCP asks it for, which
is exactly the chunks of this rank's final (deduplicated) plan. The load planner, given the recorded checksums,
verifies every stored chunk this rank reads: a stored chunk that falls whole into one of this rank's chunks is
read straight into it and checked there; one that this rank needs only part of (a load at another layout), or
in several pieces, is read whole into a scratch buffer (DCP's reader loads the whole stored chunk anyway),
checked, and its overlaps copied into place.
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, ReadItem, SavePlan, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from mpzero.checkpointing.checksums import ALGORITHMS, checksum, offsets_text
from mpzero.errors import ConfigError
from mpzero.tensor_parallel import TensorPlacement

if TYPE_CHECKING:
    from mpzero.zero import OwnedPiece


@dataclass(frozen=True)
class Chunk:
    """A rectangle of a global tensor: its offsets and sizes there, and the view of this rank's buffer that
    holds it (shape == sizes)."""
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    view: torch.Tensor


@dataclass(frozen=True)
class LocalShare:
    """This rank's chunks of one stored tensor of global shape `size` (non-overlapping; possibly none)."""
    size: tuple[int, ...]
    chunks: list[Chunk]


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


def chunks(piece: OwnedPiece, key: str, placement: TensorPlacement, tp_rank: int, tp_size: int,
           ep_rank: int = 0) -> list[Chunk]:
    """The part of `piece` that is real (not vocabulary padding), in the global tensor's coordinates, with
    views into `piece.tensors[key]`. 1-D parameters are handled as one row. A placement of k > 1 chunks (SwiGLU's
    [gate; up]) holds k blocks of the split dimension, each cut on its own: block j of this rank's rows lands at
    j * (global rows / k) + tp_rank * (local rows / k). An expert stack [experts, rows, columns] (`placement.expert`;
    tp_rank and tp_size are then the expert-TP group's) is cut expert by expert, each a 2-D weight, local expert e
    landing at global expert ep_rank * experts + e: the checkpoint is keyed by global expert index."""
    if placement.expert:
        return _expert_chunks(piece, key, placement, tp_rank, tp_size, ep_rank)
    if len(piece.shape) > 2:
        raise NotImplementedError(f"{piece.name}: checkpoints handle 1-D and 2-D parameters")
    out = []
    shape = tuple(piece.shape) if len(piece.shape) == 2 else (1, piece.shape.numel())
    k = placement.chunks
    block = max(piece.shape.numel() // k, 1)  # flat elements per local block (whole rows: chunks split dimension 0)
    for lo in range(piece.start - piece.start % block, piece.end, block):
        j, start, end = lo // block, max(lo, piece.start), min(lo + block, piece.end)
        out.extend(_block_chunks(piece, key, placement, tp_rank, tp_size, shape, j, start, end))
    return out


def _expert_chunks(piece: OwnedPiece, key: str, placement: TensorPlacement, tp_rank: int, tp_size: int,
                   ep_rank: int) -> list[Chunk]:
    experts, inner_shape = piece.shape[0], torch.Size(piece.shape[1:])
    per = inner_shape.numel()
    inner = dataclasses.replace(placement, local_shape=tuple(inner_shape), expert=False,
                                partition_dim=None if placement.partition_dim is None else placement.partition_dim - 1)
    out = []
    for e in range(piece.start // per, -(-piece.end // per)):
        start, end = max(piece.start, e * per), min(piece.end, (e + 1) * per)
        view = piece.tensors[key][start - piece.start:end - piece.start]
        one = dataclasses.replace(piece, shape=inner_shape, start=start - e * per, end=end - e * per,
                                  tensors={key: view})
        for chunk in chunks(one, key, inner, tp_rank, tp_size):
            out.append(Chunk((ep_rank * experts + e,) + chunk.offsets, (1,) + chunk.sizes,
                             chunk.view.view((1,) + chunk.sizes)))
    return out


def _block_chunks(piece, key, placement, tp_rank, tp_size, shape, j, start, end) -> list[Chunk]:
    """`chunks` for the elements [start, end) of this rank's local block j (the whole tensor when chunks is 1)."""
    out, k = [], placement.chunks
    for (row, col), (rows, cols), flat in rectangles(start, end, shape[1]):
        view = piece.tensors[key][flat - piece.start:flat - piece.start + rows * cols]
        if placement.partition_dim == 0 and len(piece.shape) == 2:
            local_rows = shape[0] // k
            row += j * local_rows * (tp_size - 1) + tp_rank * local_rows
            real_rows = min(rows, (placement.unpadded_size or row + rows) - row)  # drop vocabulary padding
            if real_rows <= 0:
                continue
            rows, view = real_rows, view[:real_rows * cols]
        elif placement.partition_dim is not None:  # split along the last (or only) dimension
            local_cols = shape[1] // k
            col += j * local_cols * (tp_size - 1) + tp_rank * local_cols
        if len(piece.shape) == 2:
            out.append(Chunk((row, col), (rows, cols), view.view(rows, cols)))
        else:
            out.append(Chunk((col,), (cols,), view))
    return out


class ChunksSavePlanner(DefaultSavePlanner):
    """Saves a {key: LocalShare} state dict: each rank writes its own chunks, straight from their views.
    The global plan (DefaultSavePlanner's) drops every repeat of a chunk (same key and offsets) but one and
    checks that the chunks stay inside their tensors and do not overlap. With `checksums`, the checksum of each
    chunk written is recorded as DCP takes it (`written_checksums()` after the save)."""

    def __init__(self, checksums: bool = True) -> None:
        super().__init__()
        self.record_checksums = checksums
        self.checksums: dict[tuple[str, tuple[int, ...]], int] = {}
        self.written: set[tuple[str, tuple[int, ...]]] = set()

    def set_up_planner(self, state_dict: dict[str, LocalShare], storage_meta=None,
                       is_coordinator: bool = False) -> None:
        self.shares = state_dict
        self.state_dict = {}
        self.mappings = {key: (key,) for key in state_dict}  # metadata.planner_data, as for a flat state dict
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, share in self.shares.items():
            for chunk in share.chunks:
                items.append(WriteItem(
                    index=MetadataIndex(key, chunk.offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(chunk.offsets),
                                                                           torch.Size(chunk.sizes)),
                                                properties=TensorProperties(dtype=chunk.view.dtype),
                                                size=torch.Size(share.size))))
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        self.written = {(item.index.fqn, tuple(item.index.offset)) for item in plan.items}
        return plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        view = _find(self.shares[write_item.index.fqn].chunks, write_item.index).view
        if not self.record_checksums:
            return view
        data = view.detach().cpu()  # DCP writes from CPU memory: a device tensor is copied once, here
        self.checksums[(write_item.index.fqn, tuple(write_item.index.offset))] = checksum(data)
        return data

    def written_checksums(self) -> dict[tuple[str, tuple[int, ...]], int]:
        """{(key, offsets): checksum} of the chunks this rank wrote."""
        missing = self.written - set(self.checksums)
        if missing:
            raise RuntimeError(f"DCP wrote {len(missing)} chunks without asking for their data, e.g. {min(missing)}")
        return {where: self.checksums[where] for where in self.written}


class ChunksLoadPlanner(DefaultLoadPlanner):
    """Loads a {key: LocalShare} state dict in place: every stored chunk that overlaps one of this rank's
    chunks is read into the overlap's view of this rank's buffer. A key the checkpoint lacks, or holds at
    another shape, is an error. `checksums`: (algorithm, {(key, offsets text): checksum}) as recorded at save;
    every stored chunk read is then verified (see the module's docstring), and the first mismatch is a
    ConfigError naming `directory`, the file and the key, ending with `advice`."""

    def __init__(self, checksums: tuple[str, dict[tuple[str, str], int]] | None = None, directory: str = "",
                 advice: str = "") -> None:
        super().__init__()
        self.checksums = checksums if checksums and checksums[0] in ALGORITHMS else None
        self.directory, self.advice = directory, advice
        self.scattered: dict[ReadItem, tuple[list[ReadItem], torch.dtype]] = {}
        self.scratch: torch.Tensor | None = None
        self.verified = 0

    def set_up_planner(self, state_dict: dict[str, LocalShare], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        self.shares = state_dict
        self.state_dict = {}
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata
        items = []
        for key, share in self.shares.items():
            md = stored.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise ConfigError(f"the checkpoint has no tensor {key!r}")
            if tuple(md.size) != tuple(share.size):
                raise ConfigError(f"the checkpoint holds {key} at {tuple(md.size)}, not {tuple(share.size)}")
            wanted = [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in share.chunks]
            reads = create_read_items_for_chunk_list(key, md, wanted)
            items += reads if self.checksums is None else self._whole_stored_chunks(key, md, reads)
        return LoadPlan(items)

    def _whole_stored_chunks(self, key: str, md: TensorStorageMetadata, reads: list[ReadItem]) -> list[ReadItem]:
        """`reads` with every stored chunk read whole: by the one read that already takes all of it, or by one
        read into a scratch buffer whose overlaps commit_tensor copies into place."""
        stored = {tuple(c.offsets): c for c in md.chunks}
        by_chunk: dict[tuple[int, ...], list[ReadItem]] = {}
        for read in reads:
            by_chunk.setdefault(tuple(read.storage_index.offset), []).append(read)
        out = []
        for offsets, group in by_chunk.items():
            sizes = tuple(stored[offsets].sizes)
            first = group[0]
            if len(group) == 1 and not any(first.storage_offsets) and tuple(first.lengths) == sizes:
                out.append(first)
                continue
            whole = ReadItem(type=LoadItemType.TENSOR, dest_index=first.storage_index,
                             dest_offsets=torch.Size([0] * len(sizes)), storage_index=first.storage_index,
                             storage_offsets=torch.Size([0] * len(sizes)), lengths=torch.Size(sizes))
            self.scattered[whole] = (group, md.properties.dtype)
            out.append(whole)
        return out

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise ConfigError(f"the checkpoint holds {read_item.dest_index.fqn!r} as bytes, not as a tensor")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        if read_item in self.scattered:
            self.scratch = torch.empty(tuple(read_item.lengths), dtype=self.scattered[read_item][1])
            return self.scratch
        return self._destination(read_item)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """The reader copies into the view resolve_tensor returned, so the buffer already holds the data;
        a storage reader that handed out a copy instead (a device or layout it had to convert) is copied
        back here."""
        if read_item in self.scattered:
            scratch, self.scratch = tensor, None  # the stored chunk, whole
            self._verify(read_item, scratch)
            for part in self.scattered[read_item][0]:
                source = scratch
                for dim, (start, length) in enumerate(zip(part.storage_offsets, part.lengths)):
                    source = source.narrow(dim, start, length)
                self._destination(part).copy_(source)
            return
        target = self._destination(read_item)
        same = (tensor.device == target.device and tensor.data_ptr() == target.data_ptr()
                and tensor.stride() == target.stride())
        if not same:
            target.copy_(tensor)
        if self.checksums is not None:
            self._verify(read_item, target)

    def _verify(self, read_item: ReadItem, whole: torch.Tensor) -> None:
        """`whole` holds the stored chunk `read_item.storage_index` in full: compare its checksum with the
        recorded one."""
        algorithm, table = self.checksums
        key, offsets = read_item.storage_index.fqn, tuple(read_item.storage_index.offset)
        expected = table.get((key, offsets_text(offsets)))
        info = self.metadata.storage_data.get(read_item.storage_index) if self.metadata.storage_data else None
        where = getattr(info, "relative_path", None) or "a .distcp file"
        if expected is None:
            raise ConfigError(f"checkpoint {self.directory}: no checksum is recorded for the chunk of {key} at "
                              f"{list(offsets)} in {where} (checksums/ is incomplete): {self.advice}")
        if checksum(whole.cpu(), algorithm) != expected:
            raise ConfigError(f"checkpoint {self.directory}: {where} holds a damaged chunk of {key} at "
                              f"{list(offsets)} ({algorithm} mismatch): {self.advice}")
        self.verified += 1

    def _destination(self, read_item: ReadItem) -> torch.Tensor:
        view = _find(self.shares[read_item.dest_index.fqn].chunks, read_item.dest_index).view
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view


def _find(chunks: list[Chunk], index: MetadataIndex) -> Chunk:
    """The chunk at `index.offset`; `index.index`, where set, is the chunk's position (a hint)."""
    if index.index is not None and index.index < len(chunks) and chunks[index.index].offsets == tuple(index.offset):
        return chunks[index.index]
    for chunk in chunks:
        if chunk.offsets == tuple(index.offset):
            return chunk
    raise KeyError(f"no chunk of {index.fqn} at offsets {tuple(index.offset)} on this rank")
