"""ZeRO stages 0, 1 and 2: every rank holds the full parameters; what differs is who holds the rest.

- `Stage0`: gradients all-reduced, optimizer states replicated: the DDP baseline, same code path.
- `Stage1`: gradients accumulated in full, reduce-scattered once at the end of the global batch;
  fp32 master weights and Adam moments exist only for this rank's 1/N slice; the updated slice
  is all-gathered back into the full parameters.
- `Stage2`: as stage 1, but only this rank's gradient slice persists: each bucket is
  reduce-scattered from the gradient hooks while backward still runs, every micro-batch.

The stage contract (what each stage exposes to the optimizer front) is `stage_base.ZeroStage`.
Parameters start from DP rank 0's values (broadcast, as DDP does), so every rank agrees.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from mpzero.comm import CommGroup
from mpzero.zero.accounting import streamed_grad_bytes
from mpzero.zero.config import OffloadConfig, PrecisionConfig, ZeroConfig
from mpzero.zero.flat import FlatLayout, bind_params, bucket_layouts, initial_values
from mpzero.zero.grads import ReplicatedGrads, ShardedGrads
from mpzero.zero.meter import TransientMeter
from mpzero.zero.offload.sink import TierBytes, Transfers
from mpzero.zero.stage_base import ZeroStage


def flatten_params(layouts: list[FlatLayout], dp: CommGroup, dtype: torch.dtype, device,
                   keep: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per bucket: the parameters' storage (`keep="full"`: the whole flat buffer, parameters bound
    to views of it; `keep="shard"`: only this rank's slice) and the fp32 values of this rank's slice
    (in fp32 the slice itself; in mixed precision an fp32 copy of the unrounded values)."""
    stores, initial = [], []
    for layout in layouts:
        values = initial_values(layout, device)
        dp.broadcast(values)
        owned = slice(layout.shard_start, layout.shard_start + layout.shard_numel)
        flat = values if dtype == torch.float32 else values.to(dtype)
        if keep == "full":
            bind_params(layout, flat)
            stores.append(flat)
        else:
            stores.append(flat[owned].clone())
        own = stores[-1][owned] if keep == "full" else stores[-1]
        initial.append(own if dtype == torch.float32 else values[owned].clone())
    return stores, initial


class _FullParams(ZeroStage):
    """Shared by stages 0-2: full flat parameter buffers, parameters bound to views of them."""

    parts_of_dp: bool  # partition states across DP (stages 1, 2) or replicate them (stage 0)

    def __init__(self, named_params, dp: CommGroup, precision: PrecisionConfig, zero: ZeroConfig, device,
                 offload: OffloadConfig | None = None):
        self.dp, self.meter, self.offload = dp, TransientMeter(), offload or OffloadConfig()
        parts, rank = (dp.size, dp.rank) if self.parts_of_dp else (1, 0)
        self.layouts = bucket_layouts(named_params, zero.bucket_numel, parts, rank)
        self.param_flats, self._initial = flatten_params(self.layouts, dp, precision.torch_dtype, device, "full")
        self.param_shards = [flat[l.shard_start:l.shard_start + l.shard_numel]
                             for flat, l in zip(self.param_flats, self.layouts)]
        self.grads = self._make_grads(precision.grad_dtype, device, zero.overlap_comm)

    @abstractmethod
    def _make_grads(self, dtype, device, overlap) -> ReplicatedGrads | ShardedGrads: ...

    def initial_master_slices(self) -> list[torch.Tensor]:
        initial, self._initial = self._initial, []
        return initial

    @property
    def grad_shards(self) -> list[torch.Tensor]:
        return self.grads.shards

    def begin_backward(self, last_micro_batch: bool) -> None:
        self.grads.begin_backward(last_micro_batch)

    def end_backward(self) -> None:
        self.grads.end_backward()

    def zero_grad(self) -> None:
        self.grads.zero_()

    def held_tensors(self) -> list[torch.Tensor]:
        return self.param_flats + self.grads.held_tensors()

    def tier_bytes(self) -> TierBytes:
        return self.grads.tier_bytes() if isinstance(self.grads, ShardedGrads) else TierBytes()

    def transfers(self) -> Transfers:
        return self.grads.transfers() if isinstance(self.grads, ShardedGrads) else Transfers()

    def host_buffer_formula(self) -> tuple[int, str]:
        return self.grads.host_buffer_formula() if isinstance(self.grads, ShardedGrads) else (0, "0")

    def after_update(self) -> None:
        if self.parts_of_dp and self.dp.size > 1:  # each rank updated its own slice: gather everyone's (at DP 1
            # the slice is the whole buffer: nothing to copy)
            for flat, shard in zip(self.param_flats, self.param_shards):
                self.dp.all_gather_into(flat, shard)  # in place: `shard` is this rank's slice of `flat`


class Stage0(_FullParams):
    number, parts_of_dp = 0, False

    def _make_grads(self, dtype, device, overlap):
        return ReplicatedGrads(self.layouts, self.dp, dtype, device, overlap, "all_reduce")


class Stage1(_FullParams):
    number, parts_of_dp = 1, True

    def _make_grads(self, dtype, device, overlap):
        return ReplicatedGrads(self.layouts, self.dp, dtype, device, overlap, "reduce_scatter")


class Stage2(_FullParams):
    number, parts_of_dp = 2, True

    def _make_grads(self, dtype, device, overlap):
        return ShardedGrads(self.layouts, self.dp, dtype, device, overlap, self.meter,
                            host=self.offload.streams_grads(self.number), pin=self.offload.pin_memory)

    def peak_working_set(self, p: int, g: int) -> tuple[int, str] | None:
        """Gradients streamed to the host (an offloaded optimizer): the device's gradient bytes in backward,
        reported as the memory line's peak (`accounting.streamed_grad_bytes`); None otherwise."""
        if not self.grads.streamed:
            return None
        return streamed_grad_bytes([l.padded_numel for l in self.layouts], [l.shard_numel for l in self.layouts], g,
                                   self.grads.overlap, streamed=True)
