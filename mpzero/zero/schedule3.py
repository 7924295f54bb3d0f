"""Stage 3's gather schedule: the trace of unit demands, its prediction from the model's structure, and its replay.

A *trace* is the order in which one micro-batch demands its units: `(unit, phase)` entries, phase "forward" (the
unit's forward), "recompute" (its forward again inside backward: a full-recomputation checkpoint replays it) or
"backward" (the gradient reached its outputs), consecutive repeats merged. `Stage3` records the first
micro-batch's trace and prefetches from it afterwards (at each demand, the next unit the trace names; with
offloaded parameters also the one after it, read ahead), as DeepSpeed's parameter coordinator and FSDP's
execution-order prefetch do; the planner predicts the same trace from the model's layers and the recomputation
flags (`predicted_trace`), so the two never disagree on what is gathered when.

`stage3_working_set` replays a trace against the code's own rules, byte by byte, with the same allocations and
frees in the same order as `Stage3`, `ShardedGrads` and `ParamTier` (every add is a candidate peak, as the
transient meter sees it): parameters p x E_u while a unit is gathered (from its gather, or prefetch, to its release
after forward, or after its gradients are ready in backward; the root through forward and again through backward);
its gradient bucket g x E_u from its first gradient to the end of its reduce-scatter (MAX_INFLIGHT_REDUCTIONS in
flight; the root's bucket held open from the first gradient of backward to its end); streamed, each reduced slice
g x S_u until the next slice's copy to the host starts (IN_TRANSIT); with offloaded parameters at DP > 1, a device
staging slot p x S_u per shard fetched or read ahead (SLOTS, read-ahead only into a free slot). The first
micro-batch (trace not yet recorded) runs without prefetch, so the figure is the larger of both replays.

Units smaller than a layer (`--zero-units linear`, ZeRO-Infinity's memory-centric tiling at the granularity of one
linear layer) are released after a recomputed forward too, `release_recomputed`, and gathered a third time for
their backward: only then does a recomputed layer hold one linear's parameters at a time, not the whole layer's.
A layer unit keeps them instead: its own backward follows its recomputation at once.
"""

from __future__ import annotations

from dataclasses import dataclass

FORWARD, RECOMPUTE, BACKWARD = "forward", "recompute", "backward"


def add_demand(trace: list[tuple[int, str]], unit: int, phase: str) -> None:
    """Record a demand, merging a repeat of the last entry (a unit whose several outputs each get a gradient)."""
    if not trace or trace[-1] != (unit, phase):
        trace.append((unit, phase))


def next_units(trace: list[tuple[int, str]], i: int, count: int) -> list[int]:
    """The next `count` distinct units after entry i that differ from its unit and from each other's neighbour:
    what a demand at entry i prefetches (and reads ahead)."""
    found, last = [], trace[i][0]
    for unit, _ in trace[i + 1:]:
        if unit != last:
            found.append(unit)
            last = unit
            if len(found) == count:
                break
    return found


def predicted_trace(layer_units: list[list[int]], recomputed: list[list[int]]) -> list[tuple[int, str]]:
    """The trace `Stage3` records for a model whose transformer layers, in forward order, hold the units
    `layer_units[i]` (indices into its layouts, the root 0 holding the rest), with full recomputation of the
    chunks of layers `recomputed` (each a list of consecutive layer indices replayed as one checkpoint; layers in
    none are not recomputed). Forward: the root, then every unit in order; backward: the root (the loss reaches
    the model's output first), then layer by layer from the last, a recomputed chunk replaying its units' forwards
    before their backwards, each layer's units in reverse."""
    trace = [(0, FORWARD)]
    for units in layer_units:
        for u in units:
            add_demand(trace, u, FORWARD)
    add_demand(trace, 0, BACKWARD)
    chunk_of = {layer: tuple(chunk) for chunk in recomputed for layer in chunk}
    layer = len(layer_units) - 1
    while layer >= 0:
        chunk = chunk_of.get(layer, (layer,))
        if layer in chunk_of:
            for i in chunk:
                for u in layer_units[i]:
                    add_demand(trace, u, RECOMPUTE)
        for i in reversed(chunk):
            for u in reversed(layer_units[i]):
                add_demand(trace, u, BACKWARD)
        layer = chunk[0] - 1
    return trace


def recompute_chunks(num_layers: int, method: str | None, n: int | None) -> list[list[int]]:
    """The layers full recomputation replays together (models/gpt.py's rule, Megatron's): "uniform" chunks of n
    consecutive layers, "block" the first n layers one by one; none without full recomputation."""
    if method == "uniform":
        return [list(range(i, min(i + n, num_layers))) for i in range(0, num_layers, n)]
    if method == "block":
        return [[i] for i in range(min(n, num_layers))]
    return []


@dataclass(frozen=True)
class Replay:
    peak: int  # bytes beyond the shards at the fullest moment
    text: str  # what is held then, a memory-line field without spaces
    gathers: tuple[int, ...]  # per unit: gathers in one micro-batch (prefetch gathers earlier, not more)

    def regathered(self, layouts) -> int:
        """Elements gathered per micro-batch beyond every unit's two gathers (forward and backward): the third
        gather of units smaller than a layer under full recomputation (`comm_theory`'s X)."""
        return sum(max(count - 2, 0) * layout.padded_numel for count, layout in zip(self.gathers, layouts))


class _Ledger:
    """The allocations of one micro-batch, in the code's order (see the module docstring)."""

    def __init__(self, full, shard, p, g, gathers, staged, overlap, streamed, release_recomputed, fp8=None):
        from mpzero.zero.grads import IN_TRANSIT, MAX_INFLIGHT_REDUCTIONS
        from mpzero.zero.offload import SLOTS
        self.full, self.shard, self.p, self.g = full, shard, p, g
        self.gathers_params, self.staged, self.overlap, self.streamed = gathers, staged, overlap, streamed
        self.release_recomputed = release_recomputed
        self.fp8 = fp8 or [None] * len(full)  # per unit: (float8 buffer, payloads in flight) bytes, or None
        self.in_flight: set[int] = set()  # units whose float8 gather's payloads are held
        self.max_inflight, self.in_transit, self.slots = MAX_INFLIGHT_REDUCTIONS, IN_TRANSIT, SLOTS
        self.now = self.peak = 0
        self.held: dict[tuple[str, int], int] = {}  # what is held now, by (kind, unit), for the text of the peak
        self.peak_held: dict[tuple[str, int], int] = {}
        self.gathered: set[int] = set()
        self.staging: dict[int, str] = {}  # unit -> "ahead" or "fetched" (device staging slots)
        self.buckets: set[int] = set()  # full gradient buffers being filled
        self.inflight: list[int] = []
        self.transit: list[int] = []
        self.launched: set[int] = set()
        self.count = [0] * len(full)

    def _add(self, kind: str, u: int, nbytes: int) -> None:
        if nbytes == 0:
            return
        self.now += nbytes
        self.held[kind, u] = self.held.get((kind, u), 0) + nbytes
        if self.now > self.peak:
            self.peak, self.peak_held = self.now, dict(self.held)

    def _sub(self, kind: str, u: int, nbytes: int) -> None:
        if nbytes == 0:  # as `_add`: an empty unit (an expert family's root) holds nothing
            return
        self.now -= nbytes
        self.held[kind, u] -= nbytes

    # -- parameters (Stage3 and ParamTier) ---------------------------------------------------------
    def _load(self, u: int, state: str) -> None:
        self.staging[u] = state
        self._add("stage", u, self.p * self.shard[u])

    def _free(self, u: int) -> None:
        del self.staging[u]
        self._sub("stage", u, self.p * self.shard[u])

    def read_ahead(self, u: int) -> None:
        if self.staged and u not in self.staging and len(self.staging) < self.slots:
            self._load(u, "ahead")

    def start_gather(self, u: int) -> None:
        if u in self.gathered or not self.gathers_params:
            return
        if self.staged and u not in self.staging and len(self.staging) == self.slots:
            if all(state == "fetched" for state in self.staging.values()):  # Stage3: finish every gather first
                for v in list(self.staging):
                    self.finish(v)
        self._add("param", u, self.p * self.full[u])
        if self.fp8[u] is not None:  # Fp8UnitGather.start: send and receive payloads, then the float8 buffer
            self._add("payload", u, self.fp8[u][1])
            self._add("float8", u, self.fp8[u][0])
            self.in_flight.add(u)
        self.gathered.add(u)
        self.count[u] += 1
        if self.staged:
            if u not in self.staging:
                if len(self.staging) == self.slots:  # evict a read-ahead
                    self._free(next(v for v, state in self.staging.items() if state == "ahead"))
                self._load(u, "fetched")
            self.staging[u] = "fetched"

    def finish(self, u: int) -> None:
        if u in self.in_flight:
            self.in_flight.discard(u)
            self._sub("payload", u, self.fp8[u][1])
        if self.staging.get(u) == "fetched":
            self._free(u)

    def release(self, u: int) -> None:
        if u in self.gathered:
            self.finish(u)
            self.gathered.discard(u)
            self._sub("param", u, self.p * self.full[u])
            if self.fp8[u] is not None:
                self._sub("float8", u, self.fp8[u][0])

    # -- gradients (ShardedGrads) --------------------------------------------------------------------
    def first_gradient(self, u: int) -> None:
        if u not in self.buckets:
            self.buckets.add(u)
            self._add("grad", u, self.g * self.full[u])

    def launch(self, u: int) -> None:
        self.buckets.discard(u)
        self.launched.add(u)
        while len(self.inflight) >= self.max_inflight:
            self._complete_oldest()
        if self.streamed:
            self._add("slice", u, self.g * self.shard[u])
        self.inflight.append(u)

    def _complete_oldest(self) -> None:
        u = self.inflight.pop(0)
        self._sub("grad", u, self.g * self.full[u])
        if self.streamed:
            while len(self.transit) >= self.in_transit:
                v = self.transit.pop(0)
                self._sub("slice", v, self.g * self.shard[v])
            self.transit.append(u)

    def ready(self, u: int) -> None:
        if self.overlap:
            self.launch(u)
        if u:
            self.release(u)

    def end_backward(self) -> None:
        for u in range(len(self.full)):
            if u not in self.launched or u in self.buckets:
                self.launch(u)
        while self.inflight:
            self._complete_oldest()
        while self.transit:
            v = self.transit.pop(0)
            self._sub("slice", v, self.g * self.shard[v])
        for u in list(self.gathered):
            self.release(u)
        for u in list(self.staging):  # tier.discard(): read-aheads dropped
            self._free(u)


def _replay(full, shard, trace, p, g, gathers, staged, prefetch, overlap, streamed, release_recomputed,
            fp8=None) -> _Ledger:
    ledger = _Ledger(full, shard, p, g, gathers, staged, overlap, streamed, release_recomputed, fp8)
    forward_done = False
    for i, (u, phase) in enumerate(trace):
        if phase != FORWARD and not forward_done:  # the model's forward returns: the root is released
            ledger.release(0)
            forward_done = True
        ledger.start_gather(u)
        ledger.finish(u)
        if prefetch:
            ahead = next_units(trace, i, 2 if staged else 1)
            if ahead:
                ledger.start_gather(ahead[0])
            if len(ahead) > 1 and ahead[1] not in ledger.gathered:
                ledger.read_ahead(ahead[1])
        if phase == FORWARD:
            if u:
                ledger.release(u)
        elif phase == RECOMPUTE:
            if u and release_recomputed:
                ledger.release(u)
        else:
            ledger.first_gradient(u)
            if u:  # the root's bucket completes last (the tied embedding's gradient), at the end of backward
                ledger.ready(u)
    if not forward_done:
        ledger.release(0)
    if 0 in ledger.buckets:
        ledger.ready(0)
    ledger.end_backward()
    return ledger


def stage3_working_set(layouts, trace: list[tuple[int, str]], p: int, g: int, gathers: bool, staged: bool,
                       prefetch: bool, overlap: bool, streamed: bool, release_recomputed: bool,
                       fp8: list[tuple[int, int] | None] | None = None) -> Replay:
    """The bytes `Stage3`'s schedule holds beyond the shards at its fullest moment, replayed over `trace` (module
    docstring), for layouts [root, unit 1, ...]. `gathers`: units are gathered (DP > 1, or parameters offloaded);
    `staged`: offloaded parameters at DP > 1 (device staging); `prefetch`, `overlap`: ZeroConfig's; `streamed`:
    gradients streamed to the host; `release_recomputed`: units smaller than a layer (`--zero-units linear`);
    `fp8`: per unit, --fp8-param-gather's (float8 buffer, send + receive payloads) bytes, or None."""
    full = [layout.padded_numel for layout in layouts]
    shard = [layout.shard_numel for layout in layouts]
    args = (full, shard, trace, p, g, gathers, staged)
    flags = (overlap, streamed, release_recomputed, fp8)
    replays = [_replay(*args, False, *flags)] + ([_replay(*args, True, *flags)] if prefetch else [])
    worst = max(replays, key=lambda ledger: ledger.peak)
    return Replay(worst.peak, _text(worst.peak_held, p, g), tuple(replays[-1].count))


def _text(held: dict[str, int], p: int, g: int) -> str:
    """The fullest moment as a memory-line field: p(...)+g(...) over the units held (R the root, Uk unit k's
    padded elements, Sk its shard), then --fp8-param-gather's bytes: Fk unit k's float8 weights, Gk its payloads in
    flight ((N + 1) x the largest rank's)."""
    def name(kind: str, u: int) -> str:
        if kind in ("param", "grad"):
            return "R" if u == 0 else f"U{u}"
        if kind in ("float8", "payload"):
            return f"{'F' if kind == 'float8' else 'G'}{u}"
        return "Sr" if u == 0 else f"S{u}"
    parts = []
    for kinds, size in ((("param", "stage"), p), (("grad", "slice"), g), (("float8", "payload"), 1)):
        names = [name(kind, u) for (kind, u), nbytes in held.items() if kind in kinds and nbytes]
        if names:
            parts.append(f"{size}({'+'.join(names)})")
    return "+".join(parts) or "0"
