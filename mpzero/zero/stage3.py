"""ZeRO stage 3: parameters partitioned too, gathered one unit at a time (FSDP2 style).

A unit is a module whose parameters are gathered and released together: by default every block of
any `nn.ModuleList` (the transformer layers); with `--zero-units linear` every linear layer inside them
(ZeRO-Infinity's memory-centric tiling at the granularity of a linear: the working set is the largest linear,
not a layer); or an explicit list. Everything else (embeddings, final LayerNorm, with linear units the layers'
norms, and any parameter registered under two names) belongs to the root unit, the model itself. Each unit
keeps this rank's 1/N slice of its flat parameter buffer; the full buffer exists only while gathered. Its
storage is resized to zero on release and back on gather, in place, so the parameters stay views of it all
along (shapes intact) and tensors autograd saved in forward (e.g. a transposed weight) see the gathered
values again in backward.

Schedule: a unit is gathered before its forward and released after it; gathered again when the gradient reaches
its outputs, or when a reentrant checkpoint re-runs its forward inside backward (a layer unit is then kept for
the backward that follows at once; a unit smaller than a layer is released, and gathered a third time for its
backward); and released once all its gradients have arrived, as they are reduce-scattered. The root is gathered
through forward (its parameters open and close it: embeddings, final LayerNorm, the tied output projection),
released between forward and backward like every unit, so that a rank then holds only its shards, gathered again
when the gradient reaches the model's output (the output projection's backward needs the tied weight) and kept
to the end of backward. Every unit is thus gathered twice per micro-batch: 2P parameter bytes, the ZeRO paper's
3P with the reduce-scatter. A unit's parameters must be used only inside that unit's forward.

Prefetch: the first micro-batch records the order of demands (`schedule3`: the trace); from then on each demand
starts gathering the next unit the trace names, as DeepSpeed's parameter coordinator does. At the peak of a step
a rank holds, beyond its shards, what `schedule3.stage3_working_set` replays from that trace: for layer units
of at most L elements and a root of R, (p + g)(R + 2L): the root, the unit computing and the prefetched one
(parameters), and the root's, the unit's and one in-flight unit's full gradient buffers. At DP 1 nothing is
partitioned: parameters are bound to the one whole copy, never gathered or released.

Parameter offload (`offload.params` cpu or disk, ZeRO-Infinity): the shards live in an `offload.params.ParamTier`
(host memory or a file), which is also where the master store writes the updated values (`param_sink()`).
A unit's shard is brought to a device staging buffer and all-gathered from there; the prefetch gathers the
next unit and starts reading the one after it, so reads overlap compute. At DP 1 the shard is copied straight
into the full buffer, which is then released like a gathered one (the one copy lives off the device). Between
steps the device holds no parameter bytes, only the gradient shards.
"""

from __future__ import annotations

from collections import Counter
from functools import partial

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from mpzero.comm import CommGroup
from mpzero.tensor_parallel import is_expert
from mpzero.zero.tiers import ParamSink, TierBytes, Transfers
from mpzero.zero.config import OffloadConfig, PrecisionConfig, ZeroConfig
from mpzero.zero.construction import (ConstructionMeters, InitialSlices, bucket_values, fully_deferred,
                                      shard_values)
from mpzero.zero.flat import build_layout, bind_params
from mpzero.zero.fp8_gather import gather_terms, unit_gathers, unit_held_bytes
from mpzero.zero.schedule3 import (BACKWARD, FORWARD, RECOMPUTE, Replay, add_demand, next_units,
                                   stage3_working_set)
from mpzero.zero.grads import ShardedGrads
from mpzero.zero.meter import TransientMeter
from mpzero.zero.stage_base import ZeroStage


def default_units(model: nn.Module, granularity: str = "layer") -> list[nn.Module]:
    """The units stage 3 gathers one at a time (`--zero-units`): "layer", every child of every outermost
    `nn.ModuleList` (the transformer layers of a GPT); "linear", every module inside those layers whose own
    `weight` is a matrix (each linear layer; the layers' norms then belong to the root)."""
    layers = []

    def visit(module):
        for child in module.children():
            if isinstance(module, nn.ModuleList):
                layers.append(child)
            else:
                visit(child)
    visit(model)
    if granularity == "layer":
        return layers
    if granularity != "linear":
        raise ValueError(f"unit granularity {granularity!r} is not one of layer, linear")
    return [m for layer in layers for m in layer.modules()
            if isinstance(getattr(m, "weight", None), nn.Parameter) and m.weight.dim() == 2]


def expert_units(model: nn.Module) -> list[nn.Module]:
    """The units of an expert family's stage 3 (families.py): every module that holds expert parameters itself
    (a mixture-of-experts layer's stacked experts), gathered when it runs; they live inside the layer units of the
    dense family, whose parameters are the rest of each layer."""
    return [m for m in model.modules() if any(is_expert(p) for p in m.parameters(recurse=False))]


def layer_units(model: nn.Module, units: list[nn.Module], kept: list[int]) -> list[list[int]]:
    """For each transformer layer (`default_units(model)`), in order, the positions in [root] + kept units of
    the units inside it: the structure `schedule3.predicted_trace` takes. `kept`: indices into `units` + 1 of
    the units that hold trainable parameters (the stage's layouts after the root)."""
    position = {id(units[k - 1]): i for i, k in enumerate(kept, start=1)}
    return [[position[id(m)] for m in layer.modules() if id(m) in position] for layer in default_units(model)]


def assign_params(model: nn.Module, units: list[nn.Module], named_params) -> list[list]:
    """named_params split into [root, unit 1, ...]; a parameter reachable twice goes to the root."""
    appearances = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    unit_of = {}
    for u, unit in enumerate(units, start=1):
        for param in unit.parameters():
            unit_of[param] = 0 if param in unit_of or appearances[id(param)] > 1 else u
    assigned = [[] for _ in range(len(units) + 1)]
    for name, param in named_params:
        assigned[unit_of.get(param, 0)].append((name, param))
    return assigned


class Stage3(ZeroStage):
    number = 3

    def __init__(self, model: nn.Module, named_params, dp: CommGroup, precision: PrecisionConfig,
                 zero: ZeroConfig, device, units: list[nn.Module] | None = None,
                 offload: OffloadConfig | None = None, directory=None, divisor: int | None = None,
                 meters: tuple[TransientMeter, ConstructionMeters] | None = None):
        """offload: where the parameter shards live (`offload.params`: none, cpu or disk); directory: this rank's
        own folder for the disk tier's file (an `OffloadDirectory`, or a path the tier locks and creates).
        `divisor` and `meters`: as for stages 0-2 (stages.py). The root may hold no parameter (an expert family's
        stage: all its parameters are in its units); it is then never gathered."""
        units = default_units(model, zero.units) if units is None else list(units)
        assigned = assign_params(model, units, named_params)
        keep = [0] + [u for u in range(1, len(assigned)) if assigned[u]]  # skip units with nothing to train
        self.modules = [([model] + units)[u] for u in keep]
        self.layouts = [build_layout(assigned[u], dp.size, dp.rank) for u in keep]
        self.dp, self.prefetch = dp, zero.prefetch
        self.meter, self.construction = meters or (TransientMeter(), ConstructionMeters())
        self.partitioned = dp.size > 1  # at DP 1 the "shard" is the whole unit: nothing to gather or release
        self.device, self.dtype = device, precision.torch_dtype
        self.tier = None
        if offload is not None and offload.params != "none":
            from mpzero.zero.offload import ParamTier  # only runs that offload parameters
            self.tier = ParamTier(self.layouts, self.dtype, device, offload, directory, self.meter, self.partitioned)
            self.param_shards = self.tier.param_shards
        else:
            self.param_shards = [torch.empty(l.shard_numel, dtype=self.dtype, device=device) for l in self.layouts]
        self.gathers = self.partitioned or self.tier is not None  # else params are bound to the one copy
        # --fp8-param-gather: the units with FP8 weights gather them in float8 (fp8_gather.py)
        self.fp8_gathers = (unit_gathers(model, self.layouts, dp, device, self.meter)
                            if zero.fp8_param_gather and self.partitioned else [None] * len(self.layouts))
        self._full = [None] * len(self.layouts)  # made with each unit (`_make_unit`)
        self._handles = [None] * len(self.layouts)
        self._gathered = [not self.gathers] * len(self.layouts)
        streamed = offload is not None and offload.streams_grads(3)
        file = None
        if streamed:  # gradients in host memory, or in a file beside a disk optimizer
            from mpzero.zero.offload import gradient_file  # only runs that offload
            file = gradient_file(offload, 3, directory, self.layouts, precision.grad_dtype, device)
        try:
            self.grads = ShardedGrads(self.layouts, dp, precision.grad_dtype, device, zero.overlap_comm, self.meter,
                                      after_ready=self._grads_ready, host=streamed,
                                      pin=streamed and offload.pin_memory, file=file, divisor=divisor)
        except BaseException:
            if file is not None:
                file.close()
            if self.tier is not None:
                self.tier.close()
            raise
        # smaller than a layer: released after a recomputed forward too, gathered again for the backward
        self.release_recomputed = zero.units == "linear"
        self.in_backward, self.trace, self._recording, self._cursor = False, [], True, None
        self._prefetched = False  # a micro-batch has run with prefetch (the peak so far includes its schedule)
        self._hooks = []
        for u, module in enumerate(self.modules):
            self._hooks.append(module.register_forward_pre_hook(partial(self._pre_forward, u)))
            self._hooks.append(module.register_forward_hook(partial(self._post_forward, u)))

    def _make_unit(self, u: int) -> tuple[torch.Tensor, TransientMeter, int]:
        """Unit u's parameters made into this rank's shard (device memory, or the offload tier) and bound to views
        of the unit's full buffer, which holds memory only while gathered (at DP 1 in memory: to the shard, the
        one whole copy). Returns the fp32 values of the shard, and the meter and bytes of the working copy that
        keeps alive (construction.py states the working set)."""
        layout, meters = self.layouts[u], self.construction
        own = slice(layout.shard_start, layout.shard_start + layout.shard_numel)
        meter = meters.device
        if not fully_deferred(layout):  # the whole unit's values, broadcast from DP rank 0
            values = bucket_values(layout, self.device, self.dp, meters)
            shard, held = values[own], 4 * values.numel()
            if self.tier is None:
                self.param_shards[u].copy_(shard)
        elif self.tier is not None:  # an offloaded shard is made on the host
            shard, meter = shard_values(layout, self.device, meters, on_host=True), meters.host
            held = 4 * shard.numel()
        elif self.dtype == torch.float32:  # the shard itself holds the fp32 values
            shard, held = shard_values(layout, self.device, meters, out=self.param_shards[u]), 0
        else:
            shard = shard_values(layout, self.device, meters)
            self.param_shards[u].copy_(shard)
            held = 4 * shard.numel()
        if self.tier is not None:
            cast = shard.to(self.dtype)
            cast_bytes = 0 if cast is shard else cast.numel() * cast.element_size()
            meters.host.add(cast_bytes)
            self.tier.write(u, 0, cast)
            del cast
            meters.host.sub(cast_bytes)
        if self.gathers:
            full = torch.empty(layout.padded_numel, dtype=self.dtype, device=self.device)
            meters.device.add(full.numel() * full.element_size())
            bind_params(layout, full)
            full.untyped_storage().resize_(0)
            meters.device.sub(layout.padded_numel * full.element_size())
            self._full[u] = full
        else:
            bind_params(layout, self.param_shards[u])
            self._full[u] = self.param_shards[u]
        return shard, meter, held

    def _placed(self) -> None:
        """Every unit made: the tier's initial writes are on disk, and its traffic counts from here."""
        if self.tier is not None:
            self.tier.finish()
            self.tier.mark()

    def replay(self, p: int, g: int) -> Replay | None:
        """`schedule3.stage3_working_set` of the recorded trace with this stage's units and settings, as far as
        they have run: the first micro-batch's schedule without prefetch, then with it (None before the first
        backward has recorded the trace)."""
        if self._recording:
            return None
        return stage3_working_set(self.layouts, self.trace, p, g, gathers=self.gathers,
                                  staged=self.tier is not None and self.partitioned,
                                  prefetch=self.prefetch and self._prefetched,
                                  overlap=self.grads.overlap, streamed=self.grads.streamed,
                                  release_recomputed=self.release_recomputed,
                                  fp8=[unit_held_bytes(layout, self._fp8_ids()) for layout in self.layouts])

    def peak_working_set(self, p: int, g: int) -> tuple[int, str] | None:
        """(bytes, formula) the schedule holds beyond the shards at its peak (the replay of its trace)."""
        replay = self.replay(p, g)
        return None if replay is None else (replay.peak, replay.text)

    def regathered_numel(self) -> int:
        """Elements all-gathered per micro-batch beyond the two gathers of every unit (forward and backward): the
        third gather of units smaller than a layer under full recomputation."""
        replay = self.replay(1, 1)
        return 0 if replay is None or not self.partitioned else replay.regathered(self.layouts)

    def fp8_gather_terms(self) -> tuple[int, int, int] | None:
        """(E, Z, A) of one gather of every unit with --fp8-param-gather (`comm_theory`), None without it."""
        replay = self.replay(1, 1)
        return gather_terms(self.layouts, self._fp8_ids(), self.dtype.itemsize, replay and replay.gathers)

    def _fp8_ids(self) -> set[int]:
        return {id(p) for unit in self.fp8_gathers if unit is not None for p in unit.weights()}

    @property
    def grad_shards(self) -> list[torch.Tensor]:
        return self.grads.shards

    def initial_master_slices(self) -> InitialSlices:
        return InitialSlices(len(self.layouts), self._make_unit, done=self._placed)

    # -- gather / release -------------------------------------------------------------------
    def _start_gather(self, u: int) -> None:
        if self._gathered[u] or not self.layouts[u].padded_numel:  # an empty root has nothing to gather
            return
        if self.tier is not None and not self.tier.can_fetch(u):  # every staging slot feeds a gather in flight
            for v in range(len(self.layouts)):
                self._finish(v)
        full = self._full[u]
        full.untyped_storage().resize_(full.nbytes)
        self.meter.add(full.nbytes)
        if self.fp8_gathers[u] is not None:  # never with offloaded parameters (check_fp8_param_gather)
            self._handles[u] = self.fp8_gathers[u].start(self.param_shards[u], full, same_weights=self.in_backward)
        elif self.tier is None:
            self._handles[u] = self.dp.all_gather_into(full, self.param_shards[u], async_op=True)
        elif self.partitioned:
            self._handles[u] = self.dp.all_gather_into(full, self.tier.fetch(u), async_op=True)
        else:
            self._handles[u] = self.tier.fetch(u, into=full)
        self._gathered[u] = True

    def _finish(self, u: int) -> None:
        """Unit u's gather (or copy) is complete, and its staging free."""
        if self._handles[u] is not None:
            self._handles[u].wait()
            self._handles[u] = None
            if self.tier is not None:
                self.tier.done(u)

    def _wait(self, u: int) -> None:
        self._start_gather(u)
        self._finish(u)

    def _release(self, u: int) -> None:
        if not self._gathered[u] or not self.gathers:
            return
        self._finish(u)  # never free a buffer a collective still writes
        self._full[u].untyped_storage().resize_(0)
        self.meter.sub(self._full[u].nbytes)
        if self.fp8_gathers[u] is not None:
            self.fp8_gathers[u].release()
        self._gathered[u] = False

    def _demand(self, u: int, phase: str) -> None:
        """Unit u is needed now: gathered (waited for), recorded in the first micro-batch's trace, and, once the
        trace is known, the unit that comes next gathered (prefetch; offloaded, the one after it read ahead)."""
        self._wait(u)
        if self._recording:
            if (u, phase) == (0, FORWARD):  # a new micro-batch (or a forward without backward) starts the trace anew
                self.trace = []
            add_demand(self.trace, u, phase)
            return
        self._cursor = self._find(u, phase)
        if not self.prefetch or self._cursor is None:
            return
        ahead = next_units(self.trace, self._cursor, 2 if self.tier is not None else 1)
        if ahead:
            self._start_gather(ahead[0])
        if len(ahead) > 1 and not self._gathered[ahead[1]]:
            self.tier.read_ahead(ahead[1])

    def _find(self, u: int, phase: str) -> int | None:
        """The trace entry of this demand: the current one, the next, or the next (else first) one that matches
        (None: a demand the trace never saw: no prefetch)."""
        start = 0 if self._cursor is None else self._cursor
        for i in [*range(start, len(self.trace)), *range(start)]:
            if self.trace[i] == (u, phase):
                return i
        return None

    # -- module and tensor hooks --------------------------------------------------------------
    def _pre_forward(self, u: int, module, args) -> None:
        self._demand(u, RECOMPUTE if self.in_backward else FORWARD)

    def _post_forward(self, u: int, module, args, output) -> None:
        if torch.is_grad_enabled():
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(partial(self._pre_backward, u))
        # Inside backward (a checkpoint's recomputation) a layer unit's own backward follows at once: kept; a unit
        # smaller than a layer is released (the rest of the layer's forward comes first). The root is released
        # after forward too: between forward and backward the rank holds only its shards; the gradient reaching
        # the model's output gathers it again (the tied output projection's backward needs the weight).
        if not self.in_backward or (u and self.release_recomputed):
            self._release(u)

    def _pre_backward(self, u: int, grad) -> None:
        self._demand(u, BACKWARD)

    def _grads_ready(self, u: int) -> None:
        if u:
            self._release(u)

    # -- the rest of the ZeroStage contract -----------------------------------------------------
    def begin_backward(self, last_micro_batch: bool) -> None:
        self.in_backward = True
        self.grads.begin_backward(last_micro_batch)

    def end_backward(self) -> None:
        self.grads.end_backward()
        for u in range(len(self.layouts)):
            self._release(u)
        if self.tier is not None:
            self.tier.discard()
        self._prefetched = not self._recording
        self.in_backward, self._recording = False, False

    def zero_grad(self) -> None:
        self.grads.zero_()

    def after_update(self) -> None:
        for u in range(len(self.layouts)):  # the next forward gathers the updated slices
            self._release(u)
        if self.tier is not None:
            self.tier.discard()
            self.tier.finish()

    def held_tensors(self) -> list[torch.Tensor]:
        if self.tier is not None:  # the shards live in the tier; staging exists only within a step
            return self.grads.held_tensors() + self._full + self.tier.staging()
        return self.param_shards + self.grads.held_tensors() + self._full

    # -- offloaded parameters --------------------------------------------------------------------------
    def param_sink(self) -> ParamSink:
        return self.tier if self.tier is not None else super().param_sink()

    def tier_bytes(self) -> TierBytes:
        return (self.tier.tier_bytes() if self.tier is not None else TierBytes()) + self.grads.tier_bytes()

    def transfers(self) -> Transfers:
        return (self.tier.traffic() if self.tier is not None else Transfers()) + self.grads.transfers()

    def host_buffer_formula(self) -> tuple[int, str]:
        tier = self.tier.host_buffer_formula() if self.tier is not None else (0, "0")
        grads = self.grads.host_buffer_formula()
        return tier[0] + grads[0], "+".join(t for t in (tier[1], grads[1]) if t != "0") or "0"

    def check_files(self) -> None:
        if self.tier is not None:
            self.tier.check_files()
        self.grads.check_files()

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
        self.grads.close()
