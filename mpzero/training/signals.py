"""SIGTERM on any rank stops every rank at the same iteration (after a checkpoint).

A scheduler may signal only some processes, or signal them at slightly different times; each rank records
the signal, and once per iteration a MAX all-reduce of that flag over the world tells every rank whether any
rank has received it, so all of them leave the loop together. The reduced flag stays on the device: the loop
reads it with the step's gradient norm, in the iteration's one synchronisation.
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

    def received_anywhere(self) -> torch.Tensor:
        """1.0 on every rank when any rank has received the signal, else 0.0: a device scalar, not read here."""
        flag = torch.full((), 1.0 if self.received else 0.0, device=self.device)  # a fill: no host-to-device copy
        self.world.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def restore(self) -> None:
        signal.signal(self.signum, self._previous)
