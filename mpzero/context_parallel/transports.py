"""How the keys and values of the other context-parallel ranks reach this one, and their gradients go back:
the ring (`--cp-comm-type p2p`) and the all-gather (`all_gather`). Both hand the attention (`attention.py`) the
same stream: the stacked [2, b, g, L, d] keys and values of each ring step's source rank, in the order of
`blocks.schedule`, and take back each source's dK and dV.

p2p (Megatron's default, TransformerEngine's ring): each step sends the K/V it holds to the next rank and receives
the previous rank's, posted before the step's block is computed, so the next K/V is in flight while this one is
used. In backward the K/V circulate again, and each source's dK/dV travel the ring with them, each rank adding its
part, until the sum reaches the rank that holds those keys. Per layer and rank, with KV the bytes of the local k and
v: forward (CP-1) KV sent; backward (CP-1) KV plus CP fp32 dK/dV (4/e KV each).
all_gather (Llama 3's choice; not overlapped): every rank's K/V gathered at once (CP KV held during the layer's
attention), again in backward, and the fp32 dK/dV of all sources reduce-scattered: forward (CP-1) KV, backward
(CP-1) KV plus (CP-1) 4/e KV.
dK/dV are summed in fp32 and cast to the keys' dtype once complete.
"""

from __future__ import annotations

import torch

from mpzero.activations import note_exchange
from mpzero.comm import CommGroup
from mpzero.context_parallel.blocks import schedule


def _post(tensor: torch.Tensor, group: CommGroup) -> tuple[list, torch.Tensor]:
    """Send `tensor` to the next rank of the ring and receive the previous rank's into a new buffer, async."""
    received = torch.empty_like(tensor)
    nxt, prev = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    return group.exchange(sends=[(tensor, nxt)], recvs=[(received, prev)], async_op=True), received


def _wait(pending: tuple[list, torch.Tensor]) -> torch.Tensor:
    requests, received = pending
    for request in requests:
        request.wait()
    return received


class Ring:
    """--cp-comm-type p2p."""

    def __init__(self, group: CommGroup):
        self.group = group

    def stream(self, kv: torch.Tensor):
        """The K/V of sources rank, rank-1, ...: step i's arrive while step i-1 computes."""
        current = kv.contiguous()
        del kv  # held as `current` only: freed once the next K/V have arrived
        for step in range(self.group.size):
            pending = None
            if step < self.group.size - 1:
                pending = _post(current, self.group)
                note_exchange(2 * current.nbytes)  # the K/V in use and the next in flight
            yield current
            if pending is not None:
                current = _wait(pending)

    def sink(self) -> _RingSums:
        return _RingSums(self.group)


class _RingSums:
    """Each step's dK/dV is for the source whose K/V the step used; the partial sum arrives from the previous
    rank (which used them one step earlier), gets this rank's part added, and goes on to the next. After the last
    step, one more hop brings every rank the complete sum for its own K/V."""

    def __init__(self, group: CommGroup):
        self.group, self.pending = group, None

    def add(self, source: int, dkv: torch.Tensor) -> None:
        total = dkv if self.pending is None else _wait(self.pending).add_(dkv)
        self.pending = _post(total, self.group)

    def result(self) -> torch.Tensor:
        return _wait(self.pending)


class AllGather:
    """--cp-comm-type all_gather."""

    def __init__(self, group: CommGroup):
        self.group = group

    def stream(self, kv: torch.Tensor):
        gathered = torch.empty((self.group.size,) + tuple(kv.shape), dtype=kv.dtype, device=kv.device)
        self.group.all_gather_into(gathered.view(-1), kv.contiguous().view(-1))
        note_exchange(kv.nbytes + gathered.nbytes)  # the local K/V and every rank's
        del kv
        for source, _ in schedule(self.group.rank, self.group.size):
            yield gathered[source]

    def sink(self) -> _GatheredSums:
        return _GatheredSums(self.group)


class _GatheredSums:
    """Every source's dK/dV in one fp32 buffer, reduce-scattered once backward's blocks are done."""

    def __init__(self, group: CommGroup):
        self.group, self.full = group, None

    def add(self, source: int, dkv: torch.Tensor) -> None:
        if self.full is None:
            self.full = torch.zeros((self.group.size,) + tuple(dkv.shape), dtype=dkv.dtype, device=dkv.device)
        self.full[source] += dkv

    def result(self) -> torch.Tensor:
        mine = torch.empty_like(self.full[0])
        self.group.reduce_scatter_into(mine.view(-1), self.full.view(-1))
        return mine


TRANSPORTS = {"p2p": Ring, "all_gather": AllGather}
