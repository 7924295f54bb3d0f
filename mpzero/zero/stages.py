"""ZeRO stages 0, 1 and 2: every rank holds the full parameters; what differs is who holds the rest.

- `Stage0`: gradients all-reduced, optimizer states replicated: the DDP baseline, same code path.
- `Stage1`: gradients accumulated in full, reduce-scattered once at the end of the global batch;
  fp32 master weights and Adam moments exist only for this rank's 1/N slice; the updated slice
  is all-gathered back into the full parameters.
- `Stage2`: as stage 1, but only this rank's gradient slice persists: each bucket is
  reduce-scattered from the gradient hooks while backward still runs, every micro-batch.

The stage contract (what each stage exposes to the optimizer front) is `stage_base.ZeroStage`.
Parameters are made bucket by bucket as the master store takes their starting values (construction.py): from
their recipes (a model built on the meta device), identical on every rank, or from their values, broadcast from
DP rank 0 (as DDP does), so every rank agrees.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from mpzero.comm import CommGroup
from mpzero.zero.accounting import streamed_grad_bytes
from mpzero.zero.config import OffloadConfig, PrecisionConfig, ZeroConfig
from mpzero.zero.construction import ConstructionMeters, InitialSlices, bucket_values
from mpzero.zero.flat import bind_params, bucket_layouts
from mpzero.zero.grads import ReplicatedGrads, ShardedGrads
from mpzero.zero.meter import TransientMeter
from mpzero.zero.tiers import TierBytes, Transfers
from mpzero.zero.stage_base import ZeroStage


class _FullParams(ZeroStage):
    """Shared by stages 0-2: full flat parameter buffers, parameters bound to views of them."""

    parts_of_dp: bool  # partition states across DP (stages 1, 2) or replicate them (stage 0)

    def __init__(self, named_params, dp: CommGroup, precision: PrecisionConfig, zero: ZeroConfig, device,
                 offload: OffloadConfig | None = None, directory=None, divisor: int | None = None,
                 meters: tuple[TransientMeter, ConstructionMeters] | None = None):
        """`directory`: the disk tier's `OffloadDirectory` (stage 2 with the optimizer on disk keeps its gradient
        slices there). `divisor`: what summed gradients are divided by (default the DP size; grads.py);
        `meters`: the transient and construction meters, when shared with another family's stage
        (families.py)."""
        self.dp, self.divisor = dp, divisor or dp.size
        self.meter, self.construction = meters or (TransientMeter(), ConstructionMeters())
        self.offload, self.directory = offload or OffloadConfig(), directory
        parts, rank = (dp.size, dp.rank) if self.parts_of_dp else (1, 0)
        self.layouts = bucket_layouts(named_params, zero.bucket_numel, parts, rank)
        self.device, self.dtype = device, precision.torch_dtype
        self.param_flats = [torch.empty(l.padded_numel, dtype=self.dtype, device=device) for l in self.layouts]
        self.param_shards = [flat[l.shard_start:l.shard_start + l.shard_numel]
                             for flat, l in zip(self.param_flats, self.layouts)]
        self.grads = self._make_grads(precision.grad_dtype, device, zero.overlap_comm)

    def _make_bucket(self, b: int) -> tuple[torch.Tensor, TransientMeter, int]:
        """Bucket b's parameters made into their flat buffer (bound to views of it); returns the fp32 values of
        this rank's slice (in fp32 the slice itself), and the meter and bytes of the fp32 copy that keeps alive."""
        layout, flat = self.layouts[b], self.param_flats[b]
        own = slice(layout.shard_start, layout.shard_start + layout.shard_numel)
        if self.dtype == torch.float32:
            bucket_values(layout, self.device, self.dp, self.construction, out=flat)
            held, values = 0, flat
        else:
            values = bucket_values(layout, self.device, self.dp, self.construction)
            flat.copy_(values)
            held = 4 * values.numel()
        bind_params(layout, flat)
        return values[own], self.construction.device, held

    @abstractmethod
    def _make_grads(self, dtype, device, overlap) -> ReplicatedGrads | ShardedGrads: ...

    def initial_master_slices(self) -> InitialSlices:
        return InitialSlices(len(self.layouts), self._make_bucket)

    @property
    def grad_shards(self) -> list[torch.Tensor]:
        return self.grads.shards

    def begin_backward(self, last_micro_batch: bool) -> None:
        self.grads.begin_backward(last_micro_batch)

    def end_backward(self) -> None:
        self.grads.end_backward()

    def zero_grad(self) -> None:
        self.grads.zero_()

    def write_gradients_together(self, params: set) -> None:
        self.grads.collector.write_together(params)

    def held_tensors(self) -> list[torch.Tensor]:
        return self.param_flats + self.grads.held_tensors()

    def tier_bytes(self) -> TierBytes:
        return self.grads.tier_bytes()

    def transfers(self) -> Transfers:
        return self.grads.transfers()

    def host_buffer_formula(self) -> tuple[int, str]:
        return self.grads.host_buffer_formula()

    def check_files(self) -> None:
        self.grads.check_files()

    def close(self) -> None:
        self.grads.close()

    def after_update(self) -> None:
        if self.parts_of_dp and self.dp.size > 1:  # each rank updated its own slice: gather everyone's (at DP 1
            # the slice is the whole buffer: nothing to copy)
            for flat, shard in zip(self.param_flats, self.param_shards):
                self.dp.all_gather_into(flat, shard)  # in place: `shard` is this rank's slice of `flat`


class Stage0(_FullParams):
    number, parts_of_dp = 0, False

    def _make_grads(self, dtype, device, overlap):
        return ReplicatedGrads(self.layouts, self.dp, dtype, device, overlap, "all_reduce", self.divisor)


class Stage1(_FullParams):
    number, parts_of_dp = 1, True

    def _make_grads(self, dtype, device, overlap):
        return ReplicatedGrads(self.layouts, self.dp, dtype, device, overlap, "reduce_scatter", self.divisor)


class Stage2(_FullParams):
    number, parts_of_dp = 2, True

    def _make_grads(self, dtype, device, overlap):
        from mpzero.zero.offload import gradient_file  # the tiers load with the runs that use them (None: no file)
        file = gradient_file(self.offload, self.number, self.directory, self.layouts, dtype, device)
        return ShardedGrads(self.layouts, self.dp, dtype, device, overlap, self.meter,
                            host=self.offload.streams_grads(self.number), pin=self.offload.pin_memory, file=file,
                            divisor=self.divisor)

    def peak_working_set(self, p: int, g: int) -> tuple[int, str] | None:
        """Gradients streamed to the host (an offloaded optimizer): the device's gradient bytes in backward,
        reported as the memory line's peak (`accounting.streamed_grad_bytes`); None otherwise."""
        if not self.grads.streamed:
            return None
        return streamed_grad_bytes([l.padded_numel for l in self.layouts], [l.shard_numel for l in self.layouts], g,
                                   self.grads.overlap, streamed=True)
