"""ZeRO-3's gather of FP8 weights (Megatron's --fp8-param-gather; torchao's float8 all-gather for FSDP).

With tensorwise FP8 (tensor_parallel/fp8.py) a unit's FP8 linears cast their whole bf16 weight to float8 in
forward and again in backward, with the scale of the weight's amax. Gathering that weight in bf16 first sends 2
bytes per element for values the linear reads only through the cast. Here each rank casts its own pieces of each
FP8 weight before the gather, with the scale of the WHOLE weight, and sends 1 byte per element:
1. the amax of this rank's pieces of each FP8 weight of the unit, one fp32 vector per unit, MAX all-reduced over
   the shard (DP) group, then over the TP group (a TP rank's weight is a slice of the whole weight, whose scale
   the FP8 linear takes over the TP group; torchao's `precompute_float8_dynamic_scale_for_fsdp` does the same
   reduction once per step), at a micro-batch's forward gather: backward's gathers reuse its scales (the weights
   have not changed), so the TP traffic is the unflagged run's, whose linears all-reduce the weight's amax once
   per micro-batch;
2. the scale is torchao's `amax_to_scale` of that amax and each piece is cast as torchao casts
   (`hp_tensor_and_scale_to_float8`: fp32 product, saturated), so every element's float8 bits are those the
   unflagged linear computes from the gathered bf16 weight: the run is bitwise the unflagged one;
3. one uint8 all-gather (gloo has no float8) of each rank's payload: its bf16 elements of the unit's other
   parameters (2 bytes each, first, so they stay 2-byte aligned), then its float8 pieces (1 byte each), padded to
   the largest rank's payload. The unit's flat layout and shards are those of the bf16 gather (so masters,
   gradients, the norm and checkpoints are unchanged): a rank's payload differs by how many of its shard's
   elements are FP8 weights, and the bytes sent are N x that largest payload, `payload_bytes`.
The float8 weights land in a per-unit buffer that holds memory only while the unit is gathered (like the bf16
buffer); each FP8 linear reads them through `GatheredFp8Weight`, and its bf16 weight (a view of the bf16 buffer,
left unwritten there) stays the autograd leaf whose gradient is reduce-scattered as before. A gather's send and
receive payloads ((N + 1) x payload bytes, until it completes) and the float8 buffer (while gathered) are counted
by stage 3's meter and replayed by `schedule3` (the F and G terms of the peak line).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mpzero.comm import CommGroup
from mpzero.errors import ConfigError
from mpzero.zero.flat import FlatLayout
from mpzero.zero.meter import TransientMeter


@dataclass(frozen=True, eq=False)
class GatheredFp8Weight:
    """An FP8 linear's weight as gathered: float8 `data` [out, in] (a view of its unit's buffer, valid while the
    unit is gathered) and its fp32 `scale` (0-dim), the values torchao's cast of the bf16 weight gives."""
    data: torch.Tensor
    scale: torch.Tensor

    def float8(self, mm_config, orig_dtype: torch.dtype):
        """torchao's Float8TrainingTensor of the weight, as `hp_tensor_and_scale_to_float8` would make it."""
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole
        return Float8TrainingTensor(self.data, self.scale, orig_dtype, mm_config, GemmInputRole.WEIGHT)


def fp8_weight_modules(model: nn.Module) -> dict[int, nn.Module]:
    """{id(weight): linear} of the model's linears in tensorwise FP8 (`use_fp8`), whose weights can be gathered
    as float8."""
    return {id(m.weight): m for m in model.modules()
            if getattr(m, "fp8", None) is not None and m.fp8.recipe.recipe == "tensorwise"}


def _segments(layout: FlatLayout, rank: int, fp8: set[int]) -> list[tuple[int, int, int | None]]:
    """(start, end, FP8 weight index or None) in flat coordinates: rank's shard split at parameter boundaries
    between FP8 weights and the rest (padding excluded)."""
    lo = rank * layout.shard_numel
    hi = min(lo + layout.shard_numel, layout.numel)
    segments = []
    for i, (offset, shape) in enumerate(zip(layout.offsets, layout.shapes)):
        start, end = max(offset, lo), min(offset + shape.numel(), hi)
        if start < end:
            key = i if i in fp8 else None
            if key is None and segments and segments[-1][2] is None and segments[-1][1] == start:
                segments[-1] = (segments[-1][0], end, None)  # one run of consecutive bf16 parameters
            else:
                segments.append((start, end, key))
    return segments


def payload_bytes(layout: FlatLayout, fp8: set[int]) -> int:
    """The bytes each rank sends into one FP8 gather of a unit: the largest rank's bf16 elements x 2 + float8
    elements x 1, rounded up to even (the next rank's bf16 part starts 2-byte aligned)."""
    most = 0
    for rank in range(layout.parts):
        most = max(most, sum((end - start) * (1 if i is not None else 2)
                             for start, end, i in _segments(layout, rank, fp8)))
    return most + most % 2


class Fp8UnitGather:
    """One stage-3 unit's gather with its FP8 linears' weights in float8 (module docstring). `modules`:
    `fp8_weight_modules(model)`; the unit's FP8 linears get their `gathered_weight` here."""

    def __init__(self, layout: FlatLayout, modules: dict[int, nn.Module], dp: CommGroup, device,
                 meter: TransientMeter):
        self.layout, self.dp, self.meter = layout, dp, meter
        self.fp8 = fp8_indices(layout, modules)
        linears = [modules[id(layout.params[i])] for i in self.fp8]
        self.tp = linears[0].fp8.group
        config = linears[0].fp8.recipe.config
        self.float8_dtype, self.round_pow2 = config.cast_config_weight.target_dtype, config.round_scales_to_power_of_2
        self.segments = [_segments(layout, r, set(self.fp8)) for r in range(layout.parts)]
        self.payload = payload_bytes(layout, set(self.fp8))
        self.start_of = {}  # FP8 weight index -> its offset in the float8 buffer
        total = 0
        for i in self.fp8:
            self.start_of[i], total = total, total + layout.shapes[i].numel()
        self.buffer = torch.empty(total, dtype=torch.uint8, device=device)
        self.scales = torch.ones(len(self.fp8), dtype=torch.float32, device=device)
        for j, (i, linear) in enumerate(zip(self.fp8, linears)):
            start = self.start_of[i]
            data = self.buffer[start:start + layout.shapes[i].numel()].view(self.float8_dtype)
            linear.gathered_weight = GatheredFp8Weight(data.view(layout.shapes[i]), self.scales[j])
        self.buffer.untyped_storage().resize_(0)

    def weights(self) -> list[nn.Parameter]:
        return [self.layout.params[i] for i in self.fp8]

    def start(self, shard: torch.Tensor, full: torch.Tensor, same_weights: bool = False):
        """Casts this rank's pieces with the whole weights' scales and starts the all-gather; the returned handle's
        `wait()` completes it into `full` (bf16) and the float8 buffer. `same_weights`: the weights are those of
        the last gather (backward's gathers follow their forward's within a step), whose scales serve again, so
        the amaxes are all-reduced once per micro-batch, as often as the unflagged linears all-reduce them over TP."""
        from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated
        own = self.segments[self.dp.rank]
        base = self.dp.rank * self.layout.shard_numel
        if not same_weights:
            amax = torch.zeros(len(self.fp8), dtype=torch.float32, device=shard.device)
            for start, end, i in own:
                if i is not None:
                    j = self.fp8.index(i)
                    amax[j] = torch.maximum(amax[j], shard[start - base:end - base].abs().max().float())
            self.dp.all_reduce(amax, op=dist.ReduceOp.MAX)
            self.tp.all_reduce(amax, op=dist.ReduceOp.MAX)
            _alias(self.scales).copy_(amax_to_scale(amax, self.float8_dtype, self.round_pow2))  # as `unpack`
        send = torch.zeros(self.payload, dtype=torch.uint8, device=shard.device)
        rest = [shard[start - base:end - base] for start, end, i in own if i is None]
        cursor = 2 * sum(piece.numel() for piece in rest)
        if rest:
            send[:cursor].view(shard.dtype).copy_(torch.cat(rest))
        for start, end, i in own:
            if i is not None:
                scaled = shard[start - base:end - base].to(torch.float32) * self.scales[self.fp8.index(i)]
                send[cursor:cursor + end - start].copy_(to_fp8_saturated(scaled, self.float8_dtype).view(torch.uint8))
                cursor += end - start
        received = torch.empty(self.layout.parts * self.payload, dtype=torch.uint8, device=shard.device)
        self.meter.add(send.nbytes + received.nbytes)
        handle = self.dp.all_gather_into(received, send, async_op=True)
        self.buffer.untyped_storage().resize_(self.buffer.nbytes)
        self.meter.add(self.buffer.nbytes)
        return _PendingGather(self, handle, send, received, full)

    def unpack(self, received: torch.Tensor, full: torch.Tensor) -> None:
        """Every rank's payload into its places: bf16 elements into `full`, float8 ones into the buffer."""
        # write through aliases of the storages: the parameters' and float8 weights' views keep their version
        # counters, so what autograd saved from the unit (a norm's weight, a compiled FP8 GEMM's operand) is not
        # seen as modified in place when backward's gather refills it
        target = _alias(full)
        buffer = _alias(self.buffer)
        rows = received.view(self.layout.parts, self.payload)
        for rank, segments in enumerate(self.segments):
            bf16 = 2 * sum(end - start for start, end, i in segments if i is None)
            rest, eight = rows[rank, :bf16].view(full.dtype), rows[rank, bf16:]
            rest_at = eight_at = 0
            for start, end, i in segments:
                n = end - start
                if i is None:
                    target[start:end].copy_(rest[rest_at:rest_at + n])
                    rest_at += n
                else:
                    at = self.start_of[i] + start - self.layout.offsets[i]
                    buffer[at:at + n].copy_(eight[eight_at:eight_at + n])
                    eight_at += n

    def release(self) -> None:
        if self.buffer.untyped_storage().nbytes():
            self.buffer.untyped_storage().resize_(0)
            self.meter.sub(self.buffer.nbytes)


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over `tensor`'s storage with a version counter of its own."""
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(tensor.untyped_storage(), 0, tensor.shape)


def fp8_indices(layout: FlatLayout, fp8_ids) -> list[int]:
    """The positions in `layout` of the parameters whose ids are in `fp8_ids` (FP8 weights gathered in float8)."""
    return [i for i, param in enumerate(layout.params) if id(param) in fp8_ids]


def gathered_bytes(layout: FlatLayout, fp8_ids) -> tuple[int, int] | None:
    """(bytes a rank sends per gather of this unit as `CommGroup` counts them before the ring factor, N x payload;
    amaxes all-reduced per micro-batch), or None for a unit without FP8 weights (gathered in bf16)."""
    fp8 = fp8_indices(layout, fp8_ids)
    return (layout.parts * payload_bytes(layout, set(fp8)), len(fp8)) if fp8 else None


def unit_held_bytes(layout: FlatLayout, fp8_ids) -> tuple[int, int] | None:
    """(the float8 buffer, a gather's send and receive payloads) bytes of a unit (`schedule3`), None without FP8
    weights."""
    fp8 = fp8_indices(layout, fp8_ids)
    if not fp8:
        return None
    return sum(layout.shapes[i].numel() for i in fp8), (layout.parts + 1) * payload_bytes(layout, set(fp8))


def gather_terms(layouts: list[FlatLayout], fp8_ids, p: int, counts=None) -> tuple[int, int, int] | None:
    """(E, Z, A) of one micro-batch (`accounting.comm_theory`): float8 elements gathered, the bytes padding the
    payloads beyond E + p x the bf16 elements, amaxes all-reduced; `counts`: each unit's gathers per micro-batch
    (`Replay.gathers`; default 2, forward and backward). None when no unit gathers float8."""
    counts = counts or [2] * len(layouts)
    eight = padding = amaxes = 0
    for layout, count in zip(layouts, counts):
        sent = gathered_bytes(layout, fp8_ids)
        if sent is not None:
            elements = sum(layout.shapes[i].numel() for i in fp8_indices(layout, fp8_ids))
            eight += count * elements
            padding += count * (sent[0] - elements - p * (layout.numel - elements))
            amaxes += sent[1]
    return (eight, padding, amaxes) if amaxes else None


def unit_gathers(model: nn.Module, layouts: list[FlatLayout], dp: CommGroup, device,
                 meter: TransientMeter) -> list[Fp8UnitGather | None]:
    """Stage 3's float8 gather of each unit with FP8 weights (None: the unit is gathered in bf16)."""
    fp8 = fp8_weight_modules(model)
    if not fp8:
        raise ConfigError("--fp8-param-gather gathers tensorwise FP8 linears' weights in float8, but the model has "
                          "none: give it --fp8-format (tensorwise), or drop --fp8-param-gather")
    return [Fp8UnitGather(layout, fp8, dp, device, meter) if fp8_indices(layout, fp8) else None for layout in layouts]


class _PendingGather:
    """A started FP8 gather: `wait()` finishes the all-gather, unpacks it and frees the send/receive buffers."""

    def __init__(self, gather: Fp8UnitGather, handle, send: torch.Tensor, received: torch.Tensor,
                 full: torch.Tensor):
        self.gather, self.handle, self.send, self.received, self.full = gather, handle, send, received, full

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
        self.gather.unpack(self.received, self.full)
        self.gather.meter.sub(self.send.nbytes + self.received.nbytes)
        self.send = self.received = None
