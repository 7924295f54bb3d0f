"""Counting the bytes a forward keeps for its backward, with `torch.autograd.graph.saved_tensors_hooks`.

    counter = SavedBytesCounter(model)
    with counter.counting():
        loss = model(tokens, labels)          # a normal training forward: the hooks only look
    counter.device_bytes    # {region: bytes}: unique storages, parameters' storages excluded
    counter.host_bytes      # {region: bytes} packed into host memory by the host tier (save_on_cpu)

A region is what the model names with `activation_region(i)` around a piece of its forward (the GPT names
each transformer layer by its index, or its trunk (embedding, layers, final norm) `COMPILED_TRUNK` when
--torch-compile runs it as one compiled region; everything else is region None). A storage is counted once, in
the region that saves it first, whatever views of it are saved; a storage that belongs to a parameter (a
weight saved by a linear, a ZeRO flat buffer) is not an activation and is left out. Count the forward only:
a recomputation inside backward saves again what it frees right after. The pack hook returns the
tensor itself: counting changes nothing in the computation.

`host_offload(enabled)`: torch's `save_on_cpu(pin_memory=True)` (pinned host memory on CUDA runs; on a CPU
run a copy within host memory), its packed copies reported to the active counter. Nested saved-tensor hooks
replace the outer ones, so what the host tier packs is not on the device and not in `device_bytes`.

`note_expert_rows(received, sent)`: the rows a mixture-of-experts layer sent into this rank's experts and the slots
it sent out, per region.

`note_exchange(nbytes)`: what a context-parallel attention holds for a moment to exchange keys and values (the
ring's two stacked K/V, the all-gather's), reported to the active counter, which keeps the largest.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from contextvars import ContextVar

import torch
from torch import nn

from mpzero.storages import storage_key

COMPILED_TRUNK = "compiled trunk"  # embedding, layers and final norm when they run as one torch.compile'd region
_REGION: ContextVar = ContextVar("mpzero_activation_region", default=None)
_ACTIVE: list = []  # the counter counting now (at most one)


@contextlib.contextmanager
def activation_region(name):
    """Saved tensors packed inside are attributed to `name` (a layer index) by an active counter."""
    token = _REGION.set(name)
    try:
        yield
    finally:
        _REGION.reset(token)


class SavedBytesCounter:
    def __init__(self, model: nn.Module):
        self.params = list(model.parameters())
        self.device_bytes: dict = defaultdict(int)
        self.host_bytes: dict = defaultdict(int)
        self.saved_tensors = 0
        self.exchange_peak = 0  # the most K/V exchange buffers a context-parallel attention held (`note_exchange`)
        self.expert_rows: dict = {}  # {region: (rows its experts received, slots it sent)} (`note_expert_rows`)
        self._seen: set = set()
        self._params: set | None = None

    def _parameter_storages(self) -> set:
        """The parameters' storages, by identity (the storage object, not its address: ZeRO stage 3 resizes its
        flat buffers in place, which moves their memory but keeps the storage); taken once."""
        if self._params is None:
            self._params = {storage_key(p) for p in self.params}
        return self._params

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.saved_tensors += 1
        storage = tensor.untyped_storage()
        key = storage_key(tensor)
        if storage.nbytes() and key not in self._seen and key not in self._parameter_storages():
            self._seen.add(key)
            self.device_bytes[_REGION.get()] += storage.nbytes()
        return tensor

    def note_host(self, packed: torch.Tensor) -> None:
        self.host_bytes[_REGION.get()] += packed.untyped_storage().nbytes()

    @contextlib.contextmanager
    def counting(self):
        if _ACTIVE:
            raise RuntimeError("another SavedBytesCounter is counting")
        _ACTIVE.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
                yield self
        finally:
            _ACTIVE.pop()

    def layer_bytes(self, num_layers: int) -> list[int]:
        return [self.device_bytes.get(i, 0) for i in range(num_layers)]

    @property
    def total_bytes(self) -> int:
        return sum(self.device_bytes.values())


def note_exchange(nbytes: int) -> None:
    """Reported by a context-parallel attention: the bytes of the K/V buffers it holds at once to exchange them
    (freed once the layer has attended: not saved for backward); the counter counting now keeps the largest."""
    if _ACTIVE:
        _ACTIVE[-1].exchange_peak = max(_ACTIVE[-1].exchange_peak, nbytes)


def note_expert_rows(received: int, sent: int = 0) -> None:
    """Reported by a mixture-of-experts dispatcher: the rows it sent into this rank's experts and the (token, slot)
    rows it sent out (data-dependent: the activation formula is evaluated at the counted rows), added to the
    region's count of the counter counting now."""
    if _ACTIVE:
        rows = _ACTIVE[-1].expert_rows
        before = rows.get(_REGION.get(), (0, 0))
        rows[_REGION.get()] = (before[0] + received, before[1] + sent)


def host_offload(enabled: bool):
    """torch.autograd.graph.save_on_cpu(pin_memory=True) when enabled (else a no-op context); the bytes it
    packs are reported to the counter counting now, if any."""
    if not enabled:
        return contextlib.nullcontext()
    hooks = torch.autograd.graph.save_on_cpu(pin_memory=True)
    pack = hooks.pack_hook

    def counted_pack(tensor):
        packed = pack(tensor)
        if _ACTIVE:
            _ACTIVE[-1].note_host(packed[1])
        return packed
    hooks.pack_hook = counted_pack
    return hooks
