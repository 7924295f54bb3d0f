"""Streamed construction: a model's parameters are made one bucket (stages 0-2) or unit (stage 3) at a time,
straight into this rank's storage, and the fp32 starting values of this rank's slices are handed to the master
store one bucket at a time, as it asks for them (DeepSpeed's zero.Init; `mpzero.deferred_init` for the recipes).

No rank holds its fp32 model: besides the model states, construction holds one bucket's working set at a time,
counted by the stage's `construction` meter as the tensors are made and dropped, and stated by
`construction_working_set` from the layouts:
- the bucket's fp32 values (`values`): stages 0-2, 4E for a bucket of E padded elements in mixed precision (in
  fp32 they are written into the parameters' own flat buffer: nothing more); stage 3, 4S, only this rank's shard
  of S elements, in mixed precision or when the shard goes to an offload tier (written straight into the shard
  otherwise), and 4E for a unit with a parameter that has no recipe (its values are the full unit's, broadcast
  from DP rank 0 as DDP does); a shard that goes to an offload tier is made on the host and then cast to the
  tier's dtype (pS, mixed), after the draws;
- the draw of one parameter (`draw`): its full fp32 tensor (4F, every TP rank draws the whole weight) and, when
  this rank's part is not a contiguous view of it (a row-parallel weight), that part's copy; at stage 3 only the
  parameters that overlap this rank's shard are drawn;
- stage 3 where units are gathered (DP > 1 or offloaded parameters): each unit's full buffer is allocated and
  released at once (pE, the largest unit; the parameters are views of it): a moment on a GPU, untouched pages
  on the host.
The device's construction peak is the model states (the memory line's formula) plus the largest device working
set (values and full buffer); the host's working set is the largest draw (or cast) beside an offloaded shard's
values. Both go on the memory line (`construction peak`, `construction host working set`) and into the planner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mpzero.comm import CommGroup
from mpzero.deferred_init import is_deferred, recipe_of
from mpzero.zero.flat import FlatLayout
from mpzero.zero.meter import TransientMeter


def draw_bytes(param: torch.Tensor) -> int:
    """Host bytes at the peak of making one deferred parameter (0 for one with storage): its full fp32 tensor,
    and this rank's part when that is a copy rather than a view (`Recipe.drawn_bytes`)."""
    recipe = recipe_of(param)
    return 0 if recipe is None else recipe.drawn_bytes()


def fully_deferred(layout: FlatLayout) -> bool:
    """Every parameter of the bucket has a recipe: each rank can make its own slice, identical on every rank."""
    return all(is_deferred(param) for param in layout.params)


class ConstructionMeters:
    """Working bytes of construction as they come and go, each meter with its high-water mark: on the device (a
    bucket's values, a unit's full buffer) and on the host (parameter draws; an offloaded shard's values and
    cast). On a machine without a GPU both are host memory, reported apart all the same."""

    def __init__(self):
        self.device, self.host = TransientMeter(), TransientMeter()


def fill_values(layout: FlatLayout, out: torch.Tensor, start: int, meters: ConstructionMeters) -> torch.Tensor:
    """Writes the fp32 values of flat elements [start, start + out.numel()) of the bucket into `out` (padding:
    zero), making each deferred parameter that overlaps them, one at a time (its draw counted on the host)."""
    out.zero_()
    end = start + out.numel()
    for i, param in enumerate(layout.params):
        lo, hi = layout.offsets[i], layout.offsets[i] + param.numel()
        a, b = max(lo, start), min(hi, end)
        if a >= b:
            continue
        recipe = recipe_of(param)
        values = recipe.values(meters.host) if recipe is not None else param.detach()
        out[a - start:b - start].copy_(values.reshape(-1)[a - lo:b - lo])
        if recipe is not None:  # what values() left counted: the part, or the full tensor it views
            meters.host.sub(values.untyped_storage().nbytes())
        del values
    return out


def bucket_values(layout: FlatLayout, device, dp: CommGroup, meters: ConstructionMeters,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The whole bucket's fp32 values (padded) on the device, in `out` when given: made from recipes, or (a
    parameter without one) read from the parameters and broadcast from DP rank 0, so that every rank starts
    alike."""
    values = out if out is not None else _counted_empty(layout.padded_numel, device, meters.device)
    fill_values(layout, values, 0, meters)
    if not fully_deferred(layout):
        dp.broadcast(values)
    return values


def shard_values(layout: FlatLayout, device, meters: ConstructionMeters, on_host: bool = False,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 values of this rank's shard of a fully deferred bucket only (no rank makes the whole bucket), on
    the device or (`on_host`: for an offload tier) in host memory."""
    meter = meters.host if on_host else meters.device
    values = out if out is not None else _counted_empty(layout.shard_numel, "cpu" if on_host else device, meter)
    return fill_values(layout, values, layout.shard_start, meters)


def _counted_empty(numel: int, device, meter: TransientMeter) -> torch.Tensor:
    values = torch.empty(numel, dtype=torch.float32, device=device)
    meter.add(4 * numel)
    return values


class InitialSlices(Sequence):
    """Per bucket, the fp32 starting values of this rank's slice, made when first asked for, in bucket order:
    `make(b)` makes bucket b (writes the stage's storage for it) and returns its slice, and the meter and bytes
    of the working tensor that slice keeps alive (counted by `make`, uncounted here once dropped); only the
    latest is kept. A master store reads them in order (its constructor); `finish()` makes whatever it did not
    ask for, then calls `done()`. Asking again for an earlier bucket is an error: its values are gone."""

    def __init__(self, count: int, make: Callable[[int], tuple[torch.Tensor, TransientMeter, int]],
                 done: Callable[[], None] | None = None):
        self._count, self._make, self._done = count, make, done
        self._next, self._latest, self._held = 0, None, None  # (meter, bytes) the latest slice keeps counted

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, bucket: int) -> torch.Tensor:
        if not 0 <= bucket < self._count:
            raise IndexError(bucket)
        if bucket < self._next - 1:
            raise RuntimeError(f"bucket {bucket}'s starting values were asked for after bucket {self._next - 1}'s: "
                               f"they are made once, in order")
        while self._next <= bucket:
            self._drop()
            self._latest, *self._held = self._make(self._next)
            self._next += 1
        return self._latest

    def _drop(self) -> None:
        self._latest = None
        if self._held is not None:
            meter, held = self._held
            meter.sub(held)
            self._held = None

    def finish(self) -> None:
        if self._count:
            self[self._count - 1]
        self._drop()
        if self._done is not None:
            self._done()
            self._done = None


@dataclass(frozen=True)
class WorkingSet:
    """The largest working set of one bucket or unit, on the device and on the host (see the module docstring)."""
    device: int
    device_text: str
    host: int
    host_text: str


def construction_working_set(layouts: list[FlatLayout], stage: int, p: int, mixed: bool,
                             params_offloaded: bool, gathers: bool) -> WorkingSet:
    """The working set `Stage*.initial_master_slices()` holds while making these layouts; call it before they are
    made (a made parameter has no recipe, and draws nothing)."""
    device, device_text, host, host_text = 0, "0", 0, "0"
    for layout in layouts:
        deferred = fully_deferred(layout)
        # stage 3 makes only the parameters that overlap this rank's shard; stages 0-2 the whole bucket
        start, end = (layout.shard_start, layout.shard_start + layout.shard_numel) if stage == 3 else (0, layout.numel)
        draw = max((draw_bytes(param) for i, param in enumerate(layout.params)
                    if layout.offsets[i] < end and start < layout.offsets[i] + param.numel()), default=0)
        on_host = 0
        if stage < 3:
            values, what = (4 * layout.padded_numel, "4E") if mixed else (0, "")
        elif not deferred:
            values, what = 4 * layout.padded_numel, "4E"
        elif params_offloaded:
            values, what, on_host = 0, "", 4 * layout.shard_numel
        elif mixed:
            values, what = 4 * layout.shard_numel, "4S"
        else:
            values, what = 0, ""
        full = p * layout.padded_numel if stage == 3 and gathers else 0  # the unit's full buffer, made and freed
        if values + full > device:
            device, device_text = values + full, "+".join(t for t in (what, f"{p}E" if full else "") if t)
        cast = p * layout.shard_numel if stage == 3 and params_offloaded and mixed else 0  # after the draws
        if on_host + max(cast, draw) > host:
            host, host_text = on_host + max(cast, draw), "+".join(
                t for t in ("4S" if on_host else "", (f"{p}S" if cast > draw else "draw") if cast or draw else "")
                if t)
    return WorkingSet(device, f"max({device_text})" if device else "0", host, f"max({host_text})" if host else "0")
