"""A storage's identity, for counting the bytes a set of tensors holds with every storage once.

Every view of a storage has the same key, and it survives an in-place resize (ZeRO stage 3 frees and refills its
flat buffers that way) and holds on tensors without data (meta and fake tensors, whose addresses are all 0).
torch gives no public identity of a storage: `tensor.untyped_storage()` is a new Python object at each call, so
the key is the StorageImpl's address (`_cdata`), as torch's own storage-sharing checks use it."""

from __future__ import annotations

import torch


def storage_key(tensor: torch.Tensor) -> tuple:
    return tensor.device, tensor.untyped_storage()._cdata


def unique_storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct, non-empty storages behind `tensors`."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            storages[storage_key(tensor)] = storage.nbytes()
    return sum(storages.values())
