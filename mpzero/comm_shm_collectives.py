"""Sum all-reduce, sum reduce-scatter and all-gather between the CPU ranks of one host through shared memory: ZeRO's
gradient reductions and parameter gathers, and tensor parallelism's, on a host whose cores all compute.

Why not gloo alone: gloo moves a collective's bytes over TCP loopback with its I/O threads, which must wait for a core
that the ranks' backward holds; at 1.07M parameters on 2 cores the gradient all-reduce was most of the 6-12 ms a
step spent above its forward and backward alone (bench/README.md, ZeRO). DeepSpeed's CPU communication op has a
shared-memory all-reduce for one node's ranks for the same reason. Here the ranks' own threads copy and sum.

Layout: each rank owns one file (comm_shm.map_shared_files: made in /dev/shm, mapped by every rank of the group,
unlinked at once): a counter on its own cache line and two buffers of CHUNK bytes, which alternate operations use.
Each operation moves at most CHUNK bytes a rank (larger tensors go chunk by chunk) in phases: a rank writes its
buffer, raises its counter to the phase's number and waits until every rank's counter has reached it. Alternating
buffers make a rank's write safe: every rank has finished operation k once all have arrived in operation k + 1, and
operation k + 2 is the next to use k's buffer. Sums run over the ranks in order 0, 1, ..., so every rank holds the
same bits, whatever the timing. Waits fail like the pipeline's (comm_shm.wait_for): a P2PTimeout after the group's
timeout, or within seconds of a peer's exit.
"""

from __future__ import annotations

import torch

from mpzero.comm_shm import map_shared_files, wait_for

CHUNK = 1 << 21  # bytes per rank per operation: 4 MiB of /dev/shm a rank, whatever the tensors
_LINE = 64


class SharedMemoryCollectives:
    """A group's collectives through shared memory (`open_shared_memory_collectives`); every rank of the group calls
    each of them in the same order, with contiguous CPU tensors of the same shapes and dtypes."""

    def __init__(self, rank: int, size: int, files: dict, timeout: float, watched: dict[int, int]):
        self.rank, self.size, self.timeout, self.watched = rank, size, timeout, watched
        self._files = files  # every rank's mapping (this rank's own included), kept while the views below live
        self._counters = [memoryview(files[r])[:_LINE].cast("q") for r in range(size)]
        self._buffers = [torch.frombuffer(files[r], dtype=torch.uint8, count=2 * CHUNK, offset=_LINE)
                         for r in range(size)]
        self._phase = 0
        self._operation = 0

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """tensor <- the sum of every rank's `tensor`: each rank sums its 1/size slice of a chunk, then every rank
        copies the others' slices."""
        flat = tensor.view(-1)
        step = CHUNK // flat.element_size()
        for start in range(0, flat.numel(), step):
            piece = flat[start:start + step]
            buffers = self._post(piece, "an all-reduce's inputs")
            bounds = [piece.numel() * r // self.size for r in range(self.size + 1)]
            mine = slice(bounds[self.rank], bounds[self.rank + 1])
            self._sum_into(piece[mine], [b[mine] for b in buffers])
            buffers[self.rank][mine].copy_(piece[mine])
            self._arrive("an all-reduce's sums")
            for r in range(self.size):
                if r != self.rank:
                    part = slice(bounds[r], bounds[r + 1])
                    piece[part].copy_(buffers[r][part])

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """shard <- this rank's 1/size slice of the sum of every rank's `full` (size * shard.numel() elements)."""
        shard, full = shard.view(-1), full.view(self.size, -1)
        step = CHUNK // (self.size * full.element_size())
        for start in range(0, shard.numel(), step):
            columns = full[:, start:start + step]
            buffers = self._post(columns, "a reduce-scatter's inputs")
            width = columns.shape[1]
            self._sum_into(shard[start:start + width],
                           [b[self.rank * width:(self.rank + 1) * width] for b in buffers])

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> None:
        """output <- every rank's `shard` in rank order (`shard` may be this rank's slice of `output`)."""
        shard, output = shard.view(-1), output.view(self.size, -1)
        step = CHUNK // shard.element_size()
        for start in range(0, shard.numel(), step):
            piece = shard[start:start + step]
            buffers = self._post(piece, "an all-gather's inputs")
            for r in range(self.size):
                if r != self.rank:
                    output[r, start:start + piece.numel()].copy_(buffers[r])
            if output[self.rank].data_ptr() != shard.data_ptr():
                output[self.rank, start:start + piece.numel()].copy_(piece)

    def _post(self, values: torch.Tensor, what: str) -> list[torch.Tensor]:
        """`values` copied into this rank's buffer of the next operation (the two halves alternate), once every rank
        has done the same: the ranks' buffers, flat, as `values`' elements."""
        half = (self._operation % 2) * CHUNK
        self._operation += 1
        nbytes = values.numel() * values.element_size()
        buffers = [b[half:half + nbytes].view(values.dtype) for b in self._buffers]
        buffers[self.rank].view(values.shape).copy_(values)
        self._arrive(what)
        return buffers

    def _arrive(self, what: str) -> None:
        self._phase += 1
        phase, counters = self._phase, self._counters
        counters[self.rank][0] = phase  # after this rank's writes: x86-64 keeps stores in order
        others = [r for r in range(self.size) if r != self.rank]
        wait_for(lambda: all(counters[r][0] >= phase for r in others),
                 f"every rank's part of {what} (phase {phase}) through shared memory",
                 f"rank {self.rank} of a group of {self.size}", self.timeout, self.watched, others)

    @staticmethod
    def _sum_into(out: torch.Tensor, parts: list[torch.Tensor]) -> None:
        """out <- parts[0] + parts[1] + ... in that order (`out` aliases none of them)."""
        if out.numel() == 0:
            return
        out.copy_(parts[0])
        for part in parts[1:]:
            out.add_(part)


def open_shared_memory_collectives(group, timeout: float):
    """Every rank of `group` (a CommGroup) calls this. (SharedMemoryCollectives, None) when its ranks share one
    x86-64 host and /dev/shm holds a file of 4 MiB for each, else (None, why); every rank gets the same answer."""
    peers = [r for r in range(group.size) if r != group.rank]
    mapped, why = map_shared_files(group, peers, _LINE + 2 * CHUNK, one_file=True)
    if mapped is None:
        return None, why
    created, opened, watched = mapped
    files = dict(opened)
    files[group.rank] = next(iter(created.values()))
    return SharedMemoryCollectives(group.rank, group.size, files, timeout, watched), None
