"""Every collective mpzero issues goes through a `CommGroup`: one place that counts bytes and
follows PyTorch's renames (torch 2.13 deprecates `all_gather_into_tensor`/`reduce_scatter_tensor`
in favour of `all_gather_single`/`reduce_scatter_single`).

Bytes are counted per rank as the bytes it sends, under the ring model for collectives (the one the ZeRO
paper's volumes assume): an all-reduce of B bytes moves 2B(N-1)/N per rank, an all-gather or reduce-scatter whose
full tensor is B bytes moves B(N-1)/N, a broadcast B(N-1)/N. Point-to-point: the bytes of each tensor sent (a
receive is the sender's count). All-to-all: the rows of the input that go to the other ranks (B(N-1)/N when even).

gloo silently reduces, broadcasts and scatters non-contiguous tensors wrongly (pytorch#192920): every tensor handed
to a collective here is contiguous, checked where the caller could pass a view.

On gloo, a group whose ranks share one x86-64 host sums, reduce-scatters and all-gathers CPU tensors through shared
memory instead (comm_shm_collectives.py), opened at the group's first such collective; the bytes counted are the
same, and the call has completed when it returns (its request's wait() returns at once).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommStats:
    """Bytes moved per rank, per collective type, since the last `reset()`."""

    def __init__(self):
        self.bytes = defaultdict(float)
        self.calls = defaultdict(int)

    def record(self, op: str, nbytes: float) -> None:
        self.bytes[op] += nbytes
        self.calls[op] += 1

    def total(self) -> float:
        return sum(self.bytes.values())

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


class SharedMemorySlot:
    """A group's shared-memory collectives, opened by its first collective that can use them (every rank of the
    group enters that one too), or None where they cannot be opened. One per set of ranks, shared by the
    CommGroups of those ranks."""

    # sums of these go through shared memory (all-gathers of any dtype copy bytes)
    SUMMED = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64)

    def __init__(self, timeout_seconds: float):
        self.timeout, self.tried, self.opened = timeout_seconds, False, None

    def get(self, group: CommGroup, tensor: torch.Tensor, summed: bool):
        if tensor.device.type != "cpu" or (summed and tensor.dtype not in self.SUMMED) or not tensor.is_contiguous():
            return None
        if not self.tried:
            self.tried = True
            if dist.get_backend(group.pg) == "gloo":
                from mpzero.comm_shm_collectives import open_shared_memory_collectives
                self.opened, _ = open_shared_memory_collectives(group, self.timeout)  # else gloo, on every rank
        return self.opened


class _Completed:
    """The request of a collective that completed before it returned."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _eager(collective):
    """A collective that runs eagerly under torch.compile (a graph break around it, compiled code on both sides):
    its byte counter is Python state that dynamo would otherwise guard on, recompiling at every call.
    `torch.compiler.disable` is applied only while dynamo traces the call: applied here, at import, it would load
    torch's compiler into every run, compiled or not (24-42 MB of RSS per process, issue 47). Traced, the call is
    the disabled function's, a graph break that runs it eagerly; untraced, the function itself."""

    @functools.wraps(collective)
    def run(*args, **kwargs):
        if torch.compiler.is_compiling():
            return torch.compiler.disable(collective)(*args, **kwargs)
        return collective(*args, **kwargs)
    return run


eager_under_compile = _eager  # for other Python-state work inside compiled modules (the MoE dispatch, moe/layer.py)


@dataclass(frozen=True)
class CommGroup:
    """A process group with its size, this rank's place in it, and a shared byte counter.

    At size 1 every collective is the identity and issues no communication, so code written for
    N ranks runs unchanged on one.
    """

    pg: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    rank: int
    stats: CommStats = field(default_factory=CommStats, compare=False)
    p2p: object | None = field(default=None, compare=False, repr=False)  # exchange's shared memory (comm_shm.py)
    shared: SharedMemorySlot | None = field(default=None, compare=False, repr=False)  # init_parallel's groups

    @property
    def size(self) -> int:
        return len(self.ranks)

    def _ring(self, nbytes: float) -> float:
        return nbytes * (self.size - 1) / self.size

    @_eager
    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op=False):
        if self.size == 1:
            return None
        self.stats.record("all_reduce", 2 * self._ring(_nbytes(tensor)))
        shared = self._shared(tensor, op)
        if shared is not None:
            shared.all_reduce(tensor)
            return _Completed() if async_op else None
        return dist.all_reduce(tensor, op=op, group=self.pg, async_op=async_op)

    def _shared(self, tensor: torch.Tensor, op):
        """This group's shared-memory collectives for `tensor` (op: a sum's, or None for a gather), or None."""
        if self.shared is None or (op is not None and op != dist.ReduceOp.SUM):
            return None
        return self.shared.get(self, tensor, summed=op is not None)

    def all_gather_cat(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `x` (same shape everywhere) concatenated in rank order along `dim`."""
        x = x.contiguous()
        gathered = torch.empty(self.size * x.numel(), dtype=x.dtype, device=x.device)
        self.all_gather_into(gathered, x.view(-1))
        return torch.cat(gathered.view(self.size, *x.shape).unbind(0), dim=dim)

    @_eager
    def all_gather_into(self, output: torch.Tensor, shard: torch.Tensor, async_op=False):
        """output (size * shard.numel()) <- this rank's `shard` concatenated in group-rank order."""
        if self.size == 1:
            output.copy_(shard.view_as(output))
            return None
        self.stats.record("all_gather", self._ring(_nbytes(output)))
        shared = self._shared(output, None) if shard.is_contiguous() else None
        if shared is not None:
            shared.all_gather(output, shard)
            return _Completed() if async_op else None
        return _all_gather_single(output, shard, group=self.pg, async_op=async_op)

    @_eager
    def reduce_scatter_into(self, shard: torch.Tensor, full: torch.Tensor, op=dist.ReduceOp.SUM,
                            async_op=False):
        """shard <- this rank's 1/size slice of the sum of `full` over the group."""
        if self.size == 1:
            shard.copy_(full.view_as(shard))
            return None
        self.stats.record("reduce_scatter", self._ring(_nbytes(full)))
        shared = self._shared(full, op) if shard.is_contiguous() else None
        if shared is not None:
            shared.reduce_scatter(shard, full)
            return _Completed() if async_op else None
        return _reduce_scatter_single(shard, full, op=op, group=self.pg, async_op=async_op)

    @_eager
    def broadcast(self, tensor: torch.Tensor, src_group_rank: int = 0):
        if self.size == 1:
            return None
        self.stats.record("broadcast", self._ring(_nbytes(tensor)))
        return dist.broadcast(tensor, src=self.ranks[src_group_rank], group=self.pg)

    @_eager
    def exchange(self, sends=(), recvs=(), async_op=False, tags=None) -> list:
        """Point-to-point: every (tensor, group rank) of `sends` sent there and every one of `recvs` received from
        there, all posted at once (torch's batch_isend_irecv, so a send and a receive between the same two ranks
        never wait on each other). `tags`: one per send then receive (gloo matches by tag; NCCL in order). Returns
        the requests when `async_op`, else waits for them."""
        tags = list(tags) if tags is not None else [0] * (len(sends) + len(recvs))
        ops = []
        for (tensor, peer), tag in zip(sends, tags):
            self.stats.record("send", _nbytes(_contiguous(tensor)))
            ops.append(dist.P2POp(dist.isend, tensor, self.ranks[peer], group=self.pg, tag=tag))
        if any(op.tensor.is_meta for op in ops) or any(tensor.is_meta for tensor, _ in recvs):
            return []  # tensors without data (a dry run): counted, nothing to move (no backend takes meta p2p)
        recvs = [(_contiguous(tensor), peer) for tensor, peer in recvs]
        if self.p2p is not None:  # the CPU ranks of one host (a pipeline's): shared memory, comm_shm.py
            requests = self.p2p.exchange(sends, recvs, tags)
        else:
            ops += [dist.P2POp(dist.irecv, tensor, self.ranks[peer], group=self.pg, tag=tag)
                    for (tensor, peer), tag in zip(recvs, tags[len(sends):])]
            requests = dist.batch_isend_irecv(ops) if ops else []
        if async_op:
            return requests
        for request in requests:
            request.wait()
        return []

    @_eager
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int] | None = None,
                          input_splits: list[int] | None = None, async_op=False):
        """output <- the rows every rank sends this one, in group-rank order; input_splits[r] rows of `input` (along
        dim 0) go to group rank r (even splits when None), output_splits[r] rows come from it."""
        if self.size == 1:
            output.copy_(input)
            return None
        rows = input.shape[0]
        kept = input_splits[self.rank] if input_splits is not None else rows // self.size
        self.stats.record("all_to_all", (rows - kept) * _nbytes(_contiguous(input)) // max(rows, 1))
        return dist.all_to_all_single(_contiguous(output), input, output_splits, input_splits, group=self.pg,
                                      async_op=async_op)

    def all_gather_objects(self, obj) -> list:
        """Small Python objects (not counted: metadata, not model state)."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def run_agreed(self, fn, catch: tuple[type[BaseException], ...], describe=str):
        """(fn()'s result or None, the first rank's error message or None): every rank runs its own part, and
        the exchange of errors (also the barrier) makes a failure on one rank a failure on all, instead of
        leaving the others waiting in their next collective."""
        result, error = None, None
        try:
            result = fn()
        except catch as failure:
            error = describe(failure)
        errors = [e for e in self.all_gather_objects(error) if e]
        return result, (errors[0] if errors else None)


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError(f"a {tuple(tensor.shape)} tensor handed to a collective is not contiguous (gloo would "
                         f"reduce or scatter it wrongly, pytorch#192920): pass .contiguous()")
    return tensor


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
