"""mpzero's own code on fake tensors: shapes, dtypes and storages, no memory (torch's `FakeTensorMode`).

The planner builds the real model under it to read parameter shapes and ZeRO layouts; the dry run
(`mpzero/dry_run.py`) runs a whole step under it. Four things the real code does that fake tensors do not
support as-is are handled here, in one place, only while `fake_tensors()` is active:

- a scalar read from a tensor (`.item()`: the loss, the gradient norm, fp16's overflow flag) has no value on a
  fake tensor: it reads 0 (no overflow, a zero norm: the step runs, nothing is clipped);
- a storage's `data_ptr()` is 0 for every fake storage, so the counts that tell storages apart by it (the
  memory report's `accounting.unique_storage_bytes`, the activation counter's `SavedBytesCounter`) would see
  one storage: a fake (meta-device) storage's `data_ptr()` is its identity instead (the StorageImpl's address),
  which groups tensors into storages exactly as data pointers do on real memory;
- a generator state saved for recomputation is cloned into a fake tensor, which has no bytes to restore:
  `torch.set_rng_state` of a fake state leaves the generator as it is (nothing draws real numbers here);
- `nn.Module.to(device)` of a module whose parameters are already fake tensors on that device (GPTEmbedding's
  position table) tries `torch.utils.swap_tensors` on the parameter, which fake tensors refuse: it is the
  identity there, as it is for real tensors already on the device.
"""

from __future__ import annotations

import contextlib
from itertools import chain

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

_storage_data_ptr = torch.UntypedStorage.data_ptr


def _data_ptr_or_identity(self: torch.UntypedStorage) -> int:
    if self.device.type == "meta":  # fake tensors' storages: no address, one identity each
        return self._cdata
    return _storage_data_ptr(self)


class _ScalarReadsAreZero(FakeTensorMode):
    """FakeTensorMode in which `.item()` (aten._local_scalar_dense) returns 0 of the tensor's kind."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            dtype = args[0].dtype
            return False if dtype == torch.bool else 0.0 if dtype.is_floating_point or dtype.is_complex else 0
        return super().__torch_dispatch__(func, types, args, kwargs)


_module_to = nn.Module.to


def _to_on_fake(self: nn.Module, *args, **kwargs):
    device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
    tensors = list(chain(self.parameters(), self.buffers()))
    if dtype is None and tensors and all(isinstance(t, FakeTensor) and (device is None or t.device == device)
                                         for t in tensors):
        return self
    return _module_to(self, *args, **kwargs)


_set_rng_state = torch.set_rng_state


def _set_rng_state_on_fake(new_state: torch.Tensor) -> None:
    if not isinstance(new_state, FakeTensor):
        _set_rng_state(new_state)


@contextlib.contextmanager
def fake_tensors():
    """Every tensor created inside is fake (no memory); see the module docstring for what changes.
    Not re-entrant, and not thread-safe: it patches three torch functions for its duration."""
    nn.Module.to, torch.set_rng_state = _to_on_fake, _set_rng_state_on_fake
    torch.UntypedStorage.data_ptr = _data_ptr_or_identity
    try:
        with _ScalarReadsAreZero(allow_non_fake_inputs=True):
            yield
    finally:
        nn.Module.to, torch.set_rng_state = _module_to, _set_rng_state
        torch.UntypedStorage.data_ptr = _storage_data_ptr
