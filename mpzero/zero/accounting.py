"""Counted model-state memory and communication beside the ZeRO paper's formulas.

Memory (per rank): P trainable parameters, N DP ranks, p / g bytes per parameter / gradient element,
K = the update rule's fp32 states (`rule.state_bytes_per_param`: 8 for AdamW's two moments, 4 for SGD's momentum
buffer) + 4 when fp32 master weights are kept apart from the parameters (mixed precision).
Stage 0: (p+g+K)P; stage 1: (p+g)P + KP/N; stage 2: pP + (g+K)P/N; stage 3: (p+g+K)P/N. With AdamW, fp16 gives the paper's 16P, 4P+12P/N, 2P+14P/N, 16P/N; bf16 (fp32 gradients, Megatron's
--accumulate-allreduce-grads-in-fp32 default) 18P, ...; bf16 with --grad-reduce-in-bf16 (g = 2) fp16's figures.
The measured side sums the unique storages this rank holds, padding included.

Communication per iteration (per rank, ring model, m micro-batches): stage 0 all-reduces gradients,
2gP(N-1)/N; stage 1 reduce-scatters gradients once and all-gathers parameters, (g+p)P(N-1)/N;
stage 2 reduce-scatters every micro-batch, (m g + p)P(N-1)/N; stage 3 gathers every unit (the root
included) for forward and again for backward and reduce-scatters gradients, every micro-batch,
m(2p + g)P(N-1)/N. With g = p these are the paper's 2P and 3P (times N-1/N).

Offload (ZeRO-Offload / ZeRO-Infinity): the optimizer's fp32 masters and states (KP/N with the master always a
separate fp32 copy there: 12P/N for AdamW, 8P/N for SGD) move to host memory or disk, and with stage 3 the parameter shards (pP/N)
too; at stages 2-3 the gradient partition (gP/N) lives in host memory as well, each reduced bucket streamed there
in backward (issue 24; `offload_tiers`): the device keeps the rest of the stage's formula (ZeRO-Offload at stage 2:
pP; stage 3 with parameters offloaded: nothing between steps). Host staging and swap buffers are a separate,
bounded term. Bytes moved per iteration: gradients device-to-host, streamed every micro-batch m gP/N (stage 1: 4P/N
in the step), parameters host-to-device pP/N (on a GPU; zero when the device is the host), the disk tier's states
read and written, KP/N each, and offloaded stage-3 parameters fetched for every gather, 2m pP/N (the step then
writes pP/N to their tier, not the device).

Stage 3's in-step peak: the shards (the formula above) plus the working set its schedule keeps gathered or
in flight (`schedule3.stage3_working_set`, the schedule replayed over its trace), counted by a meter as the
buffers are created and freed. With units smaller than a layer under full recomputation, the recomputed units
are gathered a third time: + m p X(N-1)/N for X elements so gathered (`comm_theory`'s `regathered`).

Construction (mpzero.zero.construction): the `construction peak` on the device is the model states (the formula
above) plus the largest working set of one bucket or unit, and the host's `construction working set` is one
parameter's draw (plus an offloaded shard's values and cast), each counted by a meter against its formula.

Bounded working sets (issue 24), functions the planner calls: `streamed_grad_bytes` (the device's gradient bytes
in backward: full buckets in flight and, streamed, the reduced slices on their way to the host) and
`step_fp32_bytes` (the fp32 gradient copies of a mixed-precision step: a bucket in memory, two sub-groups offloaded).

Both report lines are `|`-separated "name value" fields whose value has no spaces:
`dict(f.strip().rsplit(" ", 1) for f in line.split("|")[1:])` parses them.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpzero.zero.step_grads import PIECES_KEPT


@dataclass(frozen=True)
class PeakReport:
    """The high-water mark inside a step: the shards plus the transient buffers counted at that moment."""
    measured: int
    formula: float
    formula_text: str

    @property
    def ratio(self) -> float:
        return self.measured / self.formula


def counted_ratio(measured: float, formula: float) -> float:
    """measured / formula, the figure every report prints: 1 where both are 0, infinite where only the formula is."""
    if formula == 0:
        return 1.0 if measured == 0 else float("inf")
    return measured / formula


@dataclass(frozen=True)
class TierReport:
    """Bytes one rank holds in an offload tier ("host", "disk", "host buffers") against its formula."""
    name: str
    measured: int
    formula: float
    formula_text: str

    @property
    def ratio(self) -> float:
        return counted_ratio(self.measured, self.formula)

    def fields(self) -> str:
        key = self.name.replace(" ", "-")
        return (f" | {key} bytes {self.measured} | {key} formula {self.formula_text} | {key} formula bytes "
                f"{self.formula:.0f} | {key} ratio {self.ratio:.4f}")


@dataclass(frozen=True)
class MemoryReport:
    stage: int
    dp_size: int
    numel: int  # trainable parameters P (this TP rank's)
    measured: int  # bytes of unique storages held
    formula: float
    formula_text: str
    padding: int  # padding elements across all flat buffers
    peak: PeakReport | None = None  # stage 3, once a step has run
    expert: tuple[int, int] | None = None  # (Pe, Ne): expert parameters and their expert-DP size (families.py)
    tiers: tuple[TierReport, ...] = ()  # offloaded model states (measured/formula above: the device's share)
    construction: tuple[TierReport, ...] = ()  # construction peak (device) and working set (host), construction.py

    @property
    def ratio(self) -> float:  # a formula of 0: everything offloaded (stage 3, parameters and optimizer off device)
        return counted_ratio(self.measured, self.formula)

    def line(self) -> str:
        peak = "" if self.peak is None else (
            f" | peak bytes {self.peak.measured} | peak formula {self.peak.formula_text} | peak formula bytes "
            f"{self.peak.formula:.0f} | peak ratio {self.peak.ratio:.4f}")
        experts = "" if self.expert is None else f"expert params {self.expert[0]} | expert dp {self.expert[1]} | "
        return (f"zero memory | stage {self.stage} | dp {self.dp_size} | params {self.numel} | {experts}"
                f"measured bytes {self.measured} | formula {self.formula_text} | formula bytes {self.formula:.0f} | "
                f"ratio {self.ratio:.4f} | padding elements {self.padding}{peak}"
                f"{''.join(tier.fields() for tier in self.tiers + self.construction)}")


@dataclass(frozen=True)
class TransferReport:
    """Bytes per rank per iteration moved between device, host and disk, against theory."""
    name: str  # device-to-host, host-to-device, disk-read, disk-written
    measured: float
    theory: float
    theory_text: str

    def fields(self) -> str:
        ratio = counted_ratio(self.measured, self.theory)
        return (f" | {self.name} bytes/iter {self.measured:.0f} | {self.name} theory {self.theory_text} | "
                f"{self.name} theory bytes/iter {self.theory:.0f} | {self.name} ratio {ratio:.4f}")


@dataclass(frozen=True)
class CommReport:
    stage: int
    dp_size: int
    micro_batches: int
    measured: float  # bytes per rank per iteration, counted by CommGroup
    theory: float
    theory_text: str
    transfers: tuple[TransferReport, ...] = ()  # offload tiers' traffic (DP traffic is measured/theory)

    @property
    def ratio(self) -> float:
        return counted_ratio(self.measured, self.theory)

    def line(self) -> str:
        return (f"zero comm | stage {self.stage} | dp {self.dp_size} | micro-batches {self.micro_batches} | "
                f"measured bytes/iter {self.measured:.0f} | theory {self.theory_text} | theory bytes/iter {self.theory:.0f} | "
                f"ratio {self.ratio:.4f}{''.join(t.fields() for t in self.transfers)}")


def state_terms(stage: int, p: int, g: int, master: int, states: int) -> dict[str, tuple[int, int]]:
    """Per component (parameters, gradients, optimizer), (replicated, partitioned) bytes per parameter:
    component bytes = replicated*P + partitioned*P/N. The optimizer is K = master + states (the update rule's
    `state_bytes_per_param`: 8 for AdamW's moments)."""
    k = master + states
    return {"params": (0, p) if stage == 3 else (p, 0), "grads": (0, g) if stage >= 2 else (g, 0),
            "optimizer": (k, 0) if stage == 0 else (0, k)}


def memory_formula(stage: int, p: int, g: int, master: int, states: int,
                   offloaded: tuple[str, ...] = ()) -> tuple[int, int]:
    """(replicated, partitioned) bytes per parameter the device holds: total = replicated*P + partitioned*P/N;
    `offloaded` components ("optimizer", "params") live in another tier instead."""
    terms = [t for name, t in state_terms(stage, p, g, master, states).items() if name not in offloaded]
    return sum(r for r, _ in terms), sum(q for _, q in terms)


def offload_formula(stage: int, p: int, g: int, tiers: dict[str, str], states: int) -> dict[str, int]:
    """Bytes per parameter (all partitioned: times P/N) in each offload tier, for
    tiers = {"optimizer": "cpu"|"disk"|"none", "params": ...}: {"host": 12, "disk": 2}, say (AdamW). Offloaded
    masters are always separate fp32 copies (4 bytes beside the parameters)."""
    per_tier: dict[str, int] = {}
    terms = state_terms(stage, p, g, 4, states)
    for component, tier in tiers.items():
        if tier != "none":
            name = "host" if tier == "cpu" else tier
            per_tier[name] = per_tier.get(name, 0) + terms[component][1]
    return per_tier


def offload_tiers(stage: int, offload) -> dict[str, str]:
    """Where each offloadable component lives ("none": the device), from an `OffloadConfig`: the optimizer's
    masters and states, stage 3's parameters, and the gradient partition, streamed to host memory (and on to
    disk with the optimizer there) in backward with an offloaded optimizer at stages 2-3
    (`OffloadConfig.grads_tier`)."""
    return {"optimizer": offload.optimizer, "params": offload.params, "grads": offload.grads_tier(stage)}


def transfer_theory(p: int, numel: int, dp_size: int, micro_batches: int, tiers: dict[str, str],
                    device_is_host: bool, states: int, g: int = 4,
                    expert: tuple[int, int] | None = None) -> dict[str, tuple[float, str]]:
    """Bytes per rank per iteration between tiers (see the module docstring), with formulas; `states`: the
    rule's state bytes per parameter (the disk tier moves the master and them, K = 4 + states). Gradients go
    down as fp32 in the step, 4P/N, or, streamed in backward (tiers["grads"]), every micro-batch's reduced
    slice in the gradients' dtype, m g P/N; on disk every micro-batch's slice is written (m g P/N) and read back
    once by each later micro-batch and once by the step (m g P/N). `expert` (Pe, Ne): P/N includes Pe/Ne."""
    partition = numel / dp_size + (expert[0] / expert[1] if expert is not None else 0)
    d2h, h2d, read, written = [], [], [], []
    if tiers.get("grads", "none") != "none":
        d2h.append((micro_batches * g, f"{micro_batches * g}P/N"))
    elif tiers.get("optimizer", "none") != "none":
        d2h.append((4, "4P/N"))
    if tiers.get("optimizer", "none") != "none" and tiers.get("params", "none") == "none":
        h2d.append((p, f"{p}P/N"))  # the host step's new parameters (else written to their own tier)
    if tiers.get("optimizer") == "disk":
        k = 4 + states
        read.append((k, f"{k}P/N"))
        written.append((k, f"{k}P/N"))
    if tiers.get("grads") == "disk":
        read.append((micro_batches * g, f"{micro_batches * g}P/N"))
        written.append((micro_batches * g, f"{micro_batches * g}P/N"))
    if tiers.get("params", "none") != "none":
        fetched = 2 * micro_batches * p
        h2d.append((fetched, f"{fetched}P/N"))
        if tiers["params"] == "disk":
            read.append((fetched, f"{fetched}P/N"))
            written.append((p, f"{p}P/N"))
    out = {}
    for name, terms in (("device-to-host", d2h), ("host-to-device", h2d), ("disk-read", read),
                        ("disk-written", written)):
        if name in ("device-to-host", "host-to-device") and device_is_host:
            terms = []
        out[name] = (sum(c for c, _ in terms) * partition, "+".join(t for _, t in terms) or "0")
    return out


def formula_text(terms: list[tuple[int, str]]) -> str:
    return "+".join(f"{coef}{symbol}" for coef, symbol in terms if coef) or "0"


def memory_report(stage: int, dp_size: int, numel: int, measured: int, padding: int,
                  p: int, g: int, master: int, states: int, offloaded: tuple[str, ...] = (),
                  expert: tuple[int, int] | None = None) -> MemoryReport:
    """`numel` P over `dp_size` N ranks; `expert`: (Pe, Ne), expert parameters partitioned over their own Ne
    expert-data-parallel ranks (zero/families.py), the same terms per parameter over their own group."""
    replicated, partitioned = memory_formula(stage, p, g, master, states, offloaded)
    formula = numel * (replicated + partitioned / dp_size)
    text = formula_text([(replicated, "P"), (partitioned, "P/N")])
    if expert is not None:
        formula += expert[0] * (replicated + partitioned / expert[1])
        text += "+" + formula_text([(replicated, "Pe"), (partitioned, "Pe/Ne")])
    return MemoryReport(stage, dp_size, numel, measured, formula, text, padding, expert=expert)


def comm_theory(stage: int, dp_size: int, numel: int, p: int, g: int, micro_batches: int,
                regathered: int = 0, expert: tuple[int, int] | None = None,
                expert_regathered: int = 0, fp8_gather: tuple[int, int, int] | None = None) -> tuple[float, str]:
    """(bytes per rank per iteration, formula) for P = numel, m = micro_batches; `regathered`: X, the elements
    stage 3 gathers a third time per micro-batch (units smaller than a layer, recomputed); `expert`: (Pe, Ne),
    expert parameters reduced and gathered over their own Ne ranks, the same per parameter, Xe of them
    (`expert_regathered`) gathered a third time. `fp8_gather`: (E, Z, A) of stage 3's --fp8-param-gather
    (`Stage3.fp8_gather_terms`), per micro-batch: E elements gathered as float8 (1 byte, not p; a unit is gathered
    twice, or three times where X counts it), Z bytes padding the ranks' payloads to the largest, and A fp32
    amaxes all-reduced (8 bytes each) once."""
    m = micro_batches
    coef = {0: 2 * g, 1: g + p, 2: m * g + p, 3: m * (2 * p + g)}[stage]
    terms = [(coef, "P")] + ([(m * p, "X")] if regathered else [])
    theory, text = coef * numel + m * p * regathered, formula_text(terms)
    if fp8_gather is not None and stage == 3:
        eight, padding, amaxes = fp8_gather
        theory += m * (padding - (p - 1) * eight + 8 * amaxes)
        text += f"-{m * (p - 1)}E+{formula_text([(m, 'Z'), (8 * m, 'A')])}"
    theory, text = theory * (dp_size - 1) / dp_size, f"({text})(N-1)/N"
    if expert is not None:
        terms = [(coef, "Pe")] + ([(m * p, "Xe")] if expert_regathered else [])
        theory += (coef * expert[0] + m * p * expert_regathered) * (expert[1] - 1) / expert[1]
        text += f"+({formula_text(terms)})(Ne-1)/Ne"
    return theory, text


# -- bounded working sets of issue 24 (items 2 and 3): the formulas the planner calls --------------------------------
def step_fp32_bytes(offloaded: bool, largest_shard: int, sub_group_numel: int) -> tuple[int, str]:
    """(bytes, formula) of fp32 gradient copies a mixed-precision step holds at once when the gradient buffers are
    in the parameters' dtype (fp16, bf16 with --grad-reduce-in-bf16; fp32 buffers are used in place: 0):
    in memory one bucket's shard, 4S (S = the largest shard); offloaded the pieces of two sub-groups (the one
    updated, the one in flight), each no larger than a sub-group or a shard: 4 x 2 min(G, S) (`Fp32Buckets`)."""
    if offloaded:
        return 4 * PIECES_KEPT * min(sub_group_numel, largest_shard), f"{4 * PIECES_KEPT}min(G,S)"
    return 4 * largest_shard, "4S"


def streamed_grad_bytes(full: list[int], shard: list[int], g: int, overlap: bool, streamed: bool,
                        order: list[int] | None = None, held_open: tuple[int, ...] = ()) -> tuple[int, str]:
    """(bytes, formula): the most gradient bytes `ShardedGrads` holds on the device at once beyond persistent
    shards, replayed from its schedule. Buckets become ready in `order` (default 0, 1, ...: reverse registration,
    backward's order); each full buffer (`full[b]` elements) exists from its bucket's first gradient to the end of
    its reduce-scatter, and at most MAX_INFLIGHT_REDUCTIONS reductions run at once; `held_open` buckets receive a
    gradient first and complete last (stage 3's root: the tied embedding). Streamed (an offloaded optimizer, stages
    2-3), each reduction lands in a device slice (`shard[b]`) that stays until the next slice starts its copy to
    the host (IN_TRANSIT): with overlap, g x (2 consecutive buckets + 2 shards), whatever the model size;
    unstreamed the shards themselves persist (gP/N, counted by the memory line) and no slice is added."""
    from mpzero.zero.grads import IN_TRANSIT, MAX_INFLIGHT_REDUCTIONS
    order = list(range(len(full))) if order is None else list(order)
    state = {"now": 0, "peak": 0}
    inflight, transit = [], []

    def add(n: int) -> None:
        state["now"] += n
        state["peak"] = max(state["peak"], state["now"])

    def complete() -> None:
        bucket = inflight.pop(0)
        state["now"] -= full[bucket]
        if streamed:
            while len(transit) >= IN_TRANSIT:
                state["now"] -= shard[transit.pop(0)]
            transit.append(bucket)

    def launch(bucket: int) -> None:
        while len(inflight) >= MAX_INFLIGHT_REDUCTIONS:
            complete()
        if streamed:
            add(shard[bucket])
        inflight.append(bucket)

    for bucket in held_open:
        add(full[bucket])
    ready = [b for b in order if b not in held_open] + list(held_open)
    if overlap:
        for bucket in ready:
            if bucket not in held_open:
                add(full[bucket])
            launch(bucket)
    else:
        for bucket in ready:
            if bucket not in held_open:
                add(full[bucket])
        for bucket in range(len(full)):  # end_backward launches in bucket order
            launch(bucket)
    # the text has no spaces (a memory-line field): B buckets and S reduced slices at the fullest moment
    text = (f"{g}x(2B" + ("+2S)" if streamed else ")")) if overlap else f"{g}x(allB" + ("+S)" if streamed else ")")
    return g * state["peak"], text
