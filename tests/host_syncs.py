"""Counting host synchronisations (tests/test_host_syncs.py says what is counted and what a CPU cannot see):
`counting()` records every device read under a `TorchFunctionMode` and a `TorchDispatchMode`."""

import contextlib
import os
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.__bool__,
          torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__}
_READING_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
                aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
                aten.repeat_interleave.Tensor, aten.is_nonzero.default, aten.equal.default}
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_COUNTERS = (os.path.abspath(__file__), os.path.join(_HERE, "tests", "test_host_syncs.py"))


class HostSyncs:
    """Records every host synchronisation as (what, where): `where` is the innermost frame in this repository."""

    def __init__(self):
        self.events, self._inside_read = [], 0

    def record(self, what: str) -> None:
        frames = [f for f in traceback.extract_stack()[:-2] if f.filename.startswith(_HERE)
                  and f.filename not in _COUNTERS]
        where = f"{os.path.relpath(frames[-1].filename, _HERE)}:{frames[-1].lineno}" if frames else "?"
        self.events.append((what, where))


class _CountReads(TorchFunctionMode):
    def __init__(self, syncs: HostSyncs):
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in _READS:
            return func(*args, **(kwargs or {}))
        self.syncs.record(func.__name__)
        self.syncs._inside_read += 1  # the aten op it ends in is the same synchronisation
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.syncs._inside_read -= 1


class _CountReadingOps(TorchDispatchMode):
    def __init__(self, syncs: HostSyncs):
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (func in _READING_OPS or _masked_index(func, args)) and not self.syncs._inside_read:
            self.syncs.record(str(func))
        return func(*args, **(kwargs or {}))


def _masked_index(func, args) -> bool:
    """x[mask] and x[mask] = v: a boolean index becomes a nonzero() inside the op (seen as such on CUDA only)."""
    if func not in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])


@contextlib.contextmanager
def counting():
    """Yields a `HostSyncs` that records every host synchronisation inside the block."""
    syncs = HostSyncs()
    with _CountReads(syncs), _CountReadingOps(syncs):
        yield syncs
