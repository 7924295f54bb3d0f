"""SIGTERM on any rank stops every rank at the same iteration (after a checkpoint).

A scheduler may signal only some processes, or signal them at slightly different times; each rank records
the signal, and once per iteration a MAX all-reduce of that flag over the world tells every rank whether any
rank has received it, so all of them leave the loop together.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from mpzero.comm import CommGroup


class TerminationSignal:
    def __init__(self, world: CommGroup, device: torch.device, signum: int = signal.SIGTERM):
        self.world, self.device, self.signum = world, device, signum
        self.received = False
        self._previous = signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def received_anywhere(self) -> bool:
        flag = torch.tensor([1.0 if self.received else 0.0], device=self.device)
        self.world.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        signal.signal(self.signum, self._previous)
