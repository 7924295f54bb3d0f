"""Model-state bytes of one rank for a layout, exactly as the code allocates them, and the lines the code prints.

From the layouts (`shapes.ModelShapes.layouts`, the code's own bucketing, unit assignment and padding) this
module counts what each ZeRO stage and master store allocates per rank, so the prediction equals the
`zero memory` line's measured bytes, padding included. The formulas beside them are the code's own
(`mpzero.zero.accounting`: memory_formula, offload_formula, comm_theory, transfer_theory), stage 3's in-step
working set is `Stage3.peak_working_set`'s own formula (`accounting.stage3_working_set`), the offload buffers
`mpzero.zero.offload.sizing.buffer_bytes`, the gradient file's `gradient_file_bytes` and the parameter tier's
own sizes: `memory_line()` / `comm_line()` render the very lines a run prints.

Per rank, for buckets (or stage-3 units) b of E_b padded elements and S_b = E_b / N owned (shard) elements,
p / g bytes per parameter / gradient element:
  parameters   stages 0-2: p sum E_b (full flat buffers);  stage 3: p sum S_b (shards; DP 1: the whole copy);
               none on the device when stage 3 offloads them
  gradients    stages 0-1: g sum E_b (full buffers);  stages 2-3: g sum S_b (shards), in host memory with an
               offloaded optimizer (streamed there in backward, issue 24; + the CUDA landing buffer, g max S_b),
               on disk beside a disk optimizer (each S_b in a 4 KiB-aligned region; + 2 host region buffers)
  optimizer    fp32 masters 4 sum S_b in mixed precision (in fp32 the master is the parameter slice), the update
               rule's states (`rule.state_bytes_per_param`: AdamW 8, SGD 4) x the owned elements that are not
               padding; none on the device when offloaded
  offload      host: K sum S_b (optimizer, tier cpu; K = 4 + the rule's state bytes: AdamW 12, SGD 8) + p sum S_b (parameters, tier cpu); disk: three files of
               4 sum S_b and one of the 4 KiB-aligned unit regions, each rounded up to 4 KiB; host buffers:
               `buffer_bytes` (+ the parameter tier's 2 slots of the largest region on disk)
Transient, inside a step (beyond the states above):
  stage 3      `Stage3.peak_working_set`: gathered units, prefetch, gradient buckets, staging ((p + g)(R + 2L))
  stage 2      full gradient buckets: g x the two largest consecutive buckets with overlap (the one filling and
               the one being reduce-scattered; gradients arrive in reverse registration order), all of them
               without overlap; streamed, + the reduced slices on their way (`accounting.streamed_grad_bytes`)
  stages 0-1   none (persistent full gradient buffers, reduced in place)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mpzero.models import family_of
from mpzero.optim import AdamW, UpdateRule
from mpzero.planner.experts import moe_tp_comm_bytes
from mpzero.planner.shapes import ModelShapes
from mpzero.zero import (CommReport, FlatLayout, MemoryReport, OffloadConfig, PeakReport, PrecisionConfig, Replay,
                         TierReport, TransferReport, ZeroConfig, comm_theory, families_working_set,
                         fp8_weight_modules, gather_terms, gathered_bytes, memory_report, offload_formula,
                         offload_tiers, stage3_working_set, streamed_grad_bytes, transfer_theory, unit_held_bytes)
from mpzero.zero.offload import SLOTS, aligned_bytes, buffer_bytes, gradient_file_bytes, round_up



@dataclass(frozen=True)
class StatePlan:
    """One rank's model states for a layout: device bytes by component, offload tiers, the in-step working set,
    DP communication per iteration; `report`/`comm` are the MemoryReport/CommReport the code would build."""
    stage: int
    dp: int
    numel: int  # P: trainable parameters of this TP rank
    padding: int
    params: int  # device bytes
    grads: int
    optimizer: int
    host: int  # offloaded states in host memory
    disk: int
    host_buffers: int
    working_set: int  # transient model-state bytes at the in-step peak
    working_text: str
    comm_bytes: float  # DP bytes per rank per iteration (padding included), as CommGroup counts them
    report: MemoryReport  # what `ZeroOptimizer.memory_report()` returns (after a step: with the peak)
    comm: CommReport  # what `ZeroOptimizer.comm_report()` returns after one iteration
    state_bytes: int  # the update rule's optimizer-state bytes per parameter beside the master

    @property
    def device(self) -> int:
        """Model-state bytes on the device between steps (= the `zero memory` line's measured bytes)."""
        return self.params + self.grads + self.optimizer

    @property
    def device_peak(self) -> int:
        return self.device + self.working_set


def element_sizes(precision: PrecisionConfig) -> tuple[int, int]:
    """(p, g) as ZeroOptimizer._element_sizes: the parameters' and the gradients' bytes per element."""
    return precision.torch_dtype.itemsize, precision.grad_dtype.itemsize


def _owned_unpadded(layout: FlatLayout) -> int:
    return sum(end - start for start, end, _ in layout.decay_runs())


def stage3_plan_replay(layouts, trace, p: int, g: int, dp: int, zero: ZeroConfig, params_offloaded: bool,
                       streamed: bool = False, fp8_ids=frozenset()) -> Replay:
    """`Stage3.replay` (`schedule3.stage3_working_set` over the trace it records) for layouts built without
    tensors and the predicted trace (`ModelShapes.stage3_trace`)."""
    partitioned = dp > 1
    return stage3_working_set(list(layouts), list(trace), p, g, gathers=partitioned or params_offloaded,
                              staged=params_offloaded and partitioned, prefetch=zero.prefetch,
                              overlap=zero.overlap_comm, streamed=streamed, release_recomputed=zero.units == "linear",
                              fp8=[unit_held_bytes(layout, fp8_ids) for layout in layouts])


def stage2_working_set(layouts, g: int, overlap: bool, streamed: bool = False) -> tuple[int, str]:
    """The full gradient buckets in flight (and, streamed to the host, the reduced slices on their way):
    `accounting.streamed_grad_bytes`, ShardedGrads' schedule replayed."""
    return streamed_grad_bytes([layout.padded_numel for layout in layouts],
                               [layout.shard_numel for layout in layouts], g, overlap, streamed)


@dataclass(frozen=True)
class PlanInputs:
    """One rank's layout as `plan_states` reads it: the model's layouts (`shapes`), the ZeRO, precision and offload
    sections, DP rank `dp_rank` of `dp`, micro-batches per iteration. `cuda`: the device is a GPU (offload staging
    buffers and device<->host traffic exist); `after_step`: the report carries stage 3's peak, as the line printed
    after the first step does; `rule`: the update rule (`OptimizerConfig.rule`); `recomputed`: the model's
    `shapes.full_recompute_chunks`."""
    shapes: ModelShapes
    zero: ZeroConfig
    precision: PrecisionConfig
    dp: int
    dp_rank: int = 0
    offload: OffloadConfig | None = None  # None: nothing offloaded
    micro_batches: int = 1
    cuda: bool = True
    after_step: bool = True
    rule: UpdateRule = AdamW()
    recomputed: tuple[tuple[int, ...], ...] = ()  # layers replayed together by full recomputation (stage 3's trace)
    expert_dp: tuple[int, int] | None = None  # (size, rank) of the expert-DP group; None: DP's (EP 1)

    def family_layouts(self) -> tuple[tuple[FlatLayout, ...], ...]:
        """The layouts of each family (dense, then the experts'), over its own group."""
        zero = self.zero
        return self.shapes.family_layouts(zero.stage, self.dp, self.dp_rank, zero.bucket_numel, zero.units,
                                          self.expert_dp)

    @property
    def expert(self) -> tuple[int, int] | None:
        """(Pe, Ne): the expert family's parameters and group size (the reports' `expert`), None without experts."""
        numel = sum(p.numel() for _, p in self.shapes.experts)
        return (numel, (self.expert_dp or (self.dp, 0))[0]) if numel else None


def plan_states(inputs: PlanInputs) -> StatePlan:
    """The model states of one rank for one layout, counted as the code allocates them (the module docstring)."""
    zero, precision, dp, rule = inputs.zero, inputs.precision, inputs.dp, inputs.rule
    offload = inputs.offload or OffloadConfig()
    stage, p, g = zero.stage, *element_sizes(precision)
    families, expert = inputs.family_layouts(), inputs.expert
    sizes = [dp, expert[1] if expert else dp]  # each family's group
    layouts = sum(families, ())
    padded = sum(layout.padded_numel for layout in layouts)
    shard = sum(layout.shard_numel for layout in layouts)
    owned = sum(_owned_unpadded(layout) for layout in layouts)
    numel = sum(layout.numel for layout in families[0])  # the dense family's P (the experts' Pe: `expert`)
    opt_off, par_off = offload.optimizer != "none", offload.params != "none"

    if stage < 3:
        params = p * padded
    elif par_off:
        params = 0
    else:
        params = p * shard
    streamed = offload.streams_grads(stage)  # the gradient partition in host memory (issue 24)
    grads = 0 if streamed else g * (padded if stage < 2 else shard)
    master = 4 if opt_off or p != 4 else 0  # DeviceMasters shares fp32 parameters; offloaded masters never do
    states = rule.state_bytes_per_param
    optimizer = 0 if opt_off else master * shard + states * owned
    host, disk, host_buffers = _off_device_bytes(inputs, offload, layouts, shard, streamed)

    regathered, working, texts, counts = [0, 0], 0, [], None
    fp8_ids = fp8_weight_modules(inputs.shapes.model) if stage == 3 and zero.fp8_param_gather and dp > 1 else {}
    for f, family in enumerate(families):  # each family's working set: their sum bounds the two interleaved
        if stage == 3:  # --fp8-param-gather: the FP8 linears' weights (dense: the flag is refused with experts)
            trace = inputs.shapes.stage3_trace(zero.units, inputs.recomputed, ("dense", "expert")[f])
            replay = stage3_plan_replay(family, trace, p, g, sizes[f], zero, par_off, streamed, fp8_ids)
            part, text = replay.peak, replay.text
            counts = replay.gathers if f == 0 else counts
            if sizes[f] > 1:
                regathered[f] = replay.regathered(family)
        elif stage == 2:
            part, text = stage2_working_set(family, g, zero.overlap_comm, streamed)
        else:
            part, text = 0, "0"
        working, texts = working + part, texts + [text]
    working_text = texts[0] if len(texts) == 1 else "+".join(f"({text})" for text in texts)

    tiers = offload_tiers(stage, offload)
    report = memory_report(stage, dp, numel, params + grads + optimizer, padded - numel - (expert or (0,))[0], p, g,
                           master, states, tuple(c for c, tier in tiers.items() if tier != "none"), expert)
    report = _with_tiers_and_construction(report, inputs, offload, layouts, {"host": host, "disk": disk},
                                          host_buffers)
    # the peak the line states: one family's schedule (with experts the families' meters are shared, no formula)
    if (stage == 3 or stage == 2 and streamed) and inputs.after_step and expert is None:
        report = dataclasses.replace(report, peak=PeakReport(report.measured + working, report.formula + working,
                                                             working_text if report.formula == 0 else
                                                             f"{report.formula_text}+{working_text}"))
    comm_bytes = sum(dp_comm_bytes(stage, family, p, g, size, inputs.micro_batches, par_off, again, fp8_ids,
                                   counts if f == 0 else None)
                     for f, (family, size, again) in enumerate(zip(families, sizes, regathered)))
    comm = _comm_report(inputs, tiers, numel, comm_bytes, tuple(regathered),
                        gather_terms(families[0], fp8_ids, p, counts))
    return StatePlan(stage, dp, numel + (expert or (0,))[0], padded - numel - (expert or (0,))[0], params, grads,
                     optimizer, host, disk, host_buffers, working, working_text, comm_bytes, report, comm, states)


def _off_device_bytes(inputs: PlanInputs, offload: OffloadConfig, layouts, shard: int,
                      streamed: bool) -> tuple[int, int, int]:
    """(host, disk, host buffers): the model states the offload tiers hold, and the buffers that move them."""
    precision, rule, cuda = inputs.precision, inputs.rule, inputs.cuda
    p, g = element_sizes(precision)
    host = disk = host_buffers = 0
    if streamed and offload.grads_tier(inputs.zero.stage) == "disk":  # GradFile: aligned regions, 2 buffers
        regions, buffers = gradient_file_bytes([layout.shard_numel for layout in layouts], precision.grad_dtype)
        disk += sum(regions)
        host_buffers += buffers
    elif streamed:
        host += g * shard
        if cuda:  # ShardedGrads' pinned landing buffer for later micro-batches: one largest shard
            host_buffers += g * max((layout.shard_numel for layout in layouts), default=0)
    if offload.optimizer != "none":
        files = 1 + len(rule.state_names)  # the master and each state: one host tensor or file each
        if offload.optimizer == "cpu":
            host += files * 4 * shard
        else:
            disk += files * round_up(4 * shard)
        host_buffers += buffer_bytes(offload, shard, cuda, p, rule, staged_grads=not streamed)
    if offload.params != "none":
        if offload.params == "cpu":
            host += p * shard
        else:
            regions = [round_up(layout.shard_numel * p) // p for layout in layouts]
            disk += round_up(sum(regions) * p)
            host_buffers += SLOTS * aligned_bytes(max(regions, default=0), precision.torch_dtype)
    return host, disk, host_buffers


def _with_tiers_and_construction(report: MemoryReport, inputs: PlanInputs, offload: OffloadConfig, layouts,
                                 measured: dict[str, int], host_buffers: int) -> MemoryReport:
    """`report` with the offload tiers' lines (measured against their formula) and the construction figures."""
    stage, dp, precision = inputs.zero.stage, inputs.dp, inputs.precision
    p, g = element_sizes(precision)
    tiers = offload_tiers(stage, offload)
    if any(tier != "none" for tier in tiers.values()):
        expert = inputs.expert
        numel = sum(layout.numel for layout in layouts) - (expert or (0,))[0]
        partition = numel / dp + (expert[0] / expert[1] if expert else 0)
        per_param = offload_formula(stage, p, g, tiers, inputs.rule.state_bytes_per_param)
        tier_reports = [TierReport(name, measured[name], coef * partition, f"{coef}P/N" + (
            f"+{coef}Pe/Ne" if expert else "")) for name, coef in per_param.items()]
        tier_reports.append(TierReport("host buffers", host_buffers, host_buffers,
                                       _host_buffer_text(offload, inputs.cuda, p, inputs.rule, stage)))
        report = dataclasses.replace(report, tiers=tuple(tier_reports))
    expert = inputs.expert  # each family's stage gathers over its own group (zero/families.py)
    sizes = [dp, expert[1] if expert else dp]
    gathers = [stage == 3 and (size > 1 or offload.params != "none") for size in sizes]
    built = families_working_set(list(inputs.family_layouts()), gathers, stage, p, precision.dtype != "fp32",
                                 offload.params != "none")
    return dataclasses.replace(report, construction=(
        TierReport("construction peak", report.measured + built.device, report.formula + built.device,
                   f"{report.formula_text}+{built.device_text}"),
        TierReport("construction host working set", built.host, built.host, built.host_text)))


def _comm_report(inputs: PlanInputs, tiers: dict, numel: int, comm_bytes: float, regathered: tuple[int, int],
                 fp8_gather=None) -> CommReport:
    """What `ZeroOptimizer.comm_report()` returns after one iteration: DP bytes and the offload tiers' traffic;
    `numel`: the dense family's P, `regathered`: each family's (X, Xe), `fp8_gather`: stage 3's (E, Z, A)."""
    stage, dp, micro_batches = inputs.zero.stage, inputs.dp, inputs.micro_batches
    p, g = element_sizes(inputs.precision)
    theory, text = comm_theory(stage, dp, numel, p, g, micro_batches, regathered[0], inputs.expert, regathered[1],
                               fp8_gather=fp8_gather)
    transfers = ()
    if any(tier != "none" for tier in tiers.values()):
        expected = transfer_theory(p, numel, dp, micro_batches, tiers, device_is_host=not inputs.cuda,
                                   states=inputs.rule.state_bytes_per_param, g=g, expert=inputs.expert)
        transfers = tuple(TransferReport(name, value, value, formula) for name, (value, formula) in expected.items())
    return CommReport(stage, dp, micro_batches, comm_bytes, theory, text, transfers)


def _host_buffer_text(offload: OffloadConfig, cuda: bool, p: int, rule: UpdateRule, stage: int) -> str:
    """The formula text the code prints for the host buffers (masters' text, then the parameter tier's)."""
    parts = []
    if offload.optimizer == "disk":
        parts.append(f"{offload.buffer_count}x{1 + len(rule.state_names)} swap x 4 B")
    if cuda and not offload.streams_grads(stage):
        parts.append("2 grad staging x 4 B")
    parts.append(f"param staging x {p} B")
    if offload.grads_tier(stage) == "disk":
        parts.append("2 gradient regions")
    return "buffers: " + " + ".join(parts) + (f" + {SLOTS}U" if offload.params == "disk" else "")


def dp_comm_bytes(stage: int, layouts, p: int, g: int, dp: int, micro_batches: int,
                  params_offloaded: bool = False, regathered: int = 0, fp8_ids=frozenset(),
                  counts=None) -> float:
    """Bytes per rank per iteration on the DP group as `CommGroup` counts them (ring model, padded buffers):
    stage 0 all-reduces gradients (2g), stage 1 reduce-scatters them once and all-gathers parameters (g + p),
    stage 2 reduce-scatters every micro-batch (m g + p), stage 3 gathers every unit twice and reduce-scatters
    its gradients every micro-batch (m(2p + g)); times E (N-1)/N summed over buckets/units. A unit with FP8 weights
    in `fp8_ids` (--fp8-param-gather) sends N x its payload per gather (`counts` per micro-batch, default 2) and
    all-reduces its amaxes once per micro-batch. The loop's all-reduce
    of the iteration's loss (an fp32 scalar, for the log) is not ZeRO's traffic and is not counted there."""
    if dp == 1:
        return 0.0
    m = micro_batches
    coef = {0: 2 * g, 1: g + p, 2: m * g + p, 3: m * (2 * p + g)}[stage]
    states = sum(coef * layout.padded_numel * (dp - 1) / dp for layout in layouts)
    for layout, count in zip(layouts, counts or [2] * len(layouts)):  # --fp8-param-gather: N x payload, amaxes
        fp8 = gathered_bytes(layout, fp8_ids)
        if fp8 is not None:
            states += m * (count * (fp8[0] - p * layout.padded_numel) + 8 * fp8[1]) * (dp - 1) / dp
    return states + m * p * regathered * (dp - 1) / dp


def tp_comm_bytes(config, tp: int, micro_batch: int, seq: int, p: int, micro_batches: int, stage=None,
                  etp: int | None = None) -> float:
    """Bytes per rank per iteration on the TP group for `config` (a pipeline rank: its `stage`), parameters of `p`
    bytes: its family's formula (`ModelFamily.tp_comm_bytes`; the transformer's is
    `models.family.transformer_tp_comm_bytes`), 0 for a family that states none; with MoE layers (expert-TP `etp`,
    None: TP) what they change (`planner.experts.moe_tp_comm_bytes`)."""
    family = family_of(config)
    if not family.tp_comm_bytes:
        return 0.0
    kwargs = {} if stage is None else {"stage": stage}
    return (family.tp_comm_bytes(config, tp, micro_batch, seq, p, micro_batches, **kwargs)
            + moe_tp_comm_bytes(config, tp, micro_batch, seq, p, micro_batches, stage, etp))
