"""The contract between a master store and wherever the model's parameter slices live, and the byte counts
every holder of model state reports per tier.

A `MasterStore` (zero/masters.py, offload/masters.py) updates the fp32 masters of this rank's partition and
hands the new values, piece by piece, to a `ParamSink`: `TensorParamSink` writes them into the stage's
parameter shards (device tensors, or pinned host tensors); stage 3's offloaded parameter tier
(offload/params.py) is another sink. Coordinates are the stage's: bucket b, elements [start, start + n) of
`param_shards[b]` (this rank's slice, padding included).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class TierBytes:
    """Model-state bytes a rank holds off the device, and the buffers that move them."""
    host: int = 0  # state in host memory (unique storages; on a CPU-only run the "device" is host memory too)
    host_buffers: int = 0  # staging and swap buffers in host memory (bounded, whatever the model size)
    disk: int = 0  # state in files (bytes of the files, alignment padding included)

    def __add__(self, other: "TierBytes") -> "TierBytes":
        return TierBytes(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass(frozen=True)
class Transfers:
    """Bytes moved between tiers, cumulative since construction (the front reports per-iteration deltas)."""
    device_to_host: int = 0
    host_to_device: int = 0
    disk_read: int = 0
    disk_written: int = 0

    def __add__(self, other: "Transfers") -> "Transfers":
        return Transfers(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __sub__(self, other: "Transfers") -> "Transfers":
        return Transfers(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))


class OffloadHolder:
    """What the memory and traffic report asks of every holder of model state (a ZeroStage, a MasterStore):
    state off the device, bytes moved between tiers, its host buffers' formula, and a close for files and
    threads. Nothing offloaded by default."""

    def tier_bytes(self) -> TierBytes:
        return TierBytes()

    def transfers(self) -> Transfers:
        """Bytes moved between device, host and disk since construction."""
        return Transfers()

    def host_buffer_formula(self) -> tuple[int, str]:
        """(bytes, formula) of the staging and swap buffers allocated in host memory."""
        return 0, "0"

    def check_files(self) -> None:
        """A TrainingError (one line) when a file this holder created was deleted or cut short by someone else."""

    def close(self) -> None:
        """Release files and threads; the holder is unusable afterwards."""


class ParamSink(ABC):
    """Receives updated parameter values of this rank's partition."""

    dtype: torch.dtype  # the model's parameter dtype: values are cast to it on the way in
    device: torch.device  # where the stage computes (values may come from host memory)

    @abstractmethod
    def write(self, bucket: int, start: int, values: torch.Tensor) -> None:
        """Elements [start, start + values.numel()) of bucket's shard take `values` (any float dtype, on the
        host or the device); may return before the copy is done: `flush()` waits for it."""

    @abstractmethod
    def flush(self) -> None:
        """Every value written so far is in place (called before the stage spreads the slices)."""

    def transfers(self) -> Transfers:
        return Transfers()


class TensorParamSink(ParamSink):
    """Parameter shards that are tensors (on the device, or pinned in host memory): a write is a copy into a
    view; host-to-device copies are asynchronous on the current stream, so the source must stay untouched
    until `flush()` (pinned sources: the caller's buffers are reused only after it)."""

    def __init__(self, shards: list[torch.Tensor]):
        self.shards = shards
        self.dtype = shards[0].dtype if shards else torch.float32
        self.device = shards[0].device if shards else torch.device("cpu")
        self._host_to_device = 0

    def write(self, bucket: int, start: int, values: torch.Tensor) -> None:
        target = self.shards[bucket][start:start + values.numel()]
        if values.device != target.device:
            self._host_to_device += target.numel() * target.element_size()
        target.copy_(values, non_blocking=values.device.type == "cpu" and values.is_pinned())

    def flush(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def transfers(self) -> Transfers:
        return Transfers(host_to_device=self._host_to_device)
