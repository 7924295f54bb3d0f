"""Layouts of a training run and what each needs per rank: the planner's core, without any I/O.

A `Layout` is one way to run the same model on `world` ranks: TP size, context-parallel size, pipeline stages (and
their schedule: virtual stages, zero bubble), ZeRO stage, offload tiers, recomputation, micro-batch; DP = world /
(TP x CP x PP). The planner receives the run as typed sections (`RunSections`, resolved by its caller with the
flags' own functions: `mpzero.cli.planner_sections`); `Layout.apply` puts a layout's choices into them, and
`Planner.evaluate(layout)` counts the model states with `states.plan_states` (the code's layouts and formulas), the
activations with `activations.activation_plan` (the activation-memory module), the TP traffic, and the cost
(`cost.py`), and says whether it fits the machine. With pipeline parallelism every pipeline rank is evaluated for
its own stage (`planner.pipeline`: the stage built on meta as a run builds it, ZeRO over that stage's DP, the
activations of the micro-batches the schedule holds on it, its point-to-point bytes); the largest device peak
decides what fits, the slowest stage the time.

Device bytes per rank at the peak = the largest of three moments (+ the reserve the user states: CUDA context,
allocator slack, fragmentation, not modeled):
  construction   the model states plus one bucket's or unit's working set while they are made (streamed
                 construction, `mpzero.zero.construction.construction_working_set`)
  backward       model states between steps + the in-step working set (stage 3's gathered units, prefetch and
                 gradient buckets; stage 2's full gradient buckets) + activations (a micro-batch's saved tensors,
                 plus one recomputed layer) + the largest working tensor (`transients.compute_transients`); an
                 upper bound: these peak at nearby moments of backward, not all at once
  optimizer step model states + the step's working tensors
Host bytes per node = ranks per node x (offloaded states + host buffers); disk bytes per node likewise.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass, field
from typing import Any

from mpzero.context_parallel import cp_comm_theory
from mpzero.errors import ConfigError
from mpzero.moe import check_expert_grid, check_moe
from mpzero.parallel import GridSizes
from mpzero.pipeline import PipelineConfig, check_composition
from mpzero.planner.activations import ActivationPlan, activation_plan, normalized
from mpzero.planner.choices import context_fits, expert_grids, offloads, schedules
from mpzero.planner.cost import Cost, Hardware, layout_cost
from mpzero.planner.experts import ep_comm_bytes, recomputed_layers
from mpzero.planner.pipeline import (bubble_fraction, hidden_state_bytes, in_flight_bytes, pipeline_comm_bytes,
                                     pipeline_stages, stage_classes, tied_bytes)
from mpzero.planner.shapes import full_recompute_chunks, model_shapes
from mpzero.planner.states import PlanInputs, StatePlan, element_sizes, plan_states, tp_comm_bytes
from mpzero.planner.transients import compute_transients
from mpzero.zero import (ZERO_UNITS, OffloadConfig, OptimizerConfig, PrecisionConfig, ZeroConfig, check_zero_units,
                         step_fp32_bytes)

TIERS = ("none", "cpu", "disk")


@dataclass(frozen=True)
class RunSections:
    """The run to lay out, as pretrain_gpt.py resolves it: the sections a layout changes (the model's
    recomputation and sequence parallelism, ZeRO's stage and units, the offload tiers) and the batch it keeps."""
    model: Any  # the model family's config (a GPTConfig)
    zero: ZeroConfig
    offload: OffloadConfig
    optimizer: OptimizerConfig
    precision: PrecisionConfig
    seq_length: int
    global_batch_size: int | None = None  # None: micro-batch x DP, as pretrain_gpt.py resolves it
    pipeline: PipelineConfig = PipelineConfig()  # uneven first/last stages, embedding/loss accounting


@dataclass(frozen=True)
class Layout:
    tp: int
    dp: int
    stage: int
    micro_batch: int
    global_batch: int
    offload_optimizer: str = "none"
    offload_params: str = "none"
    recompute: str = "none"  # none, selective, full
    sequence_parallel: bool = False
    units: str = "layer"  # stage 3's units (--zero-units): layer, or linear (each linear layer gathered alone)
    cp: int = 1  # context-parallel ranks (--context-parallel-size): ZeRO partitions over DP x CP
    pp: int = 1  # pipeline stages (--pipeline-model-parallel-size)
    virtual_stages: int = 1  # model chunks per pipeline rank (--num-virtual-stages-per-pipeline-rank)
    zero_bubble: bool = False  # ZB-H1 (--enable-zero-bubble)
    ep: int = 1  # expert-parallel ranks (--expert-model-parallel-size), folded over TP x CP x DP
    expert_tp: int | None = None  # --expert-tensor-parallel-size; None: TP (Megatron's default)

    @property
    def grid(self) -> GridSizes:
        return GridSizes(tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, etp=self.expert_tp)

    @property
    def expert_dp(self) -> int:
        """The expert-DP size (Megatron's folding: TP x CP x DP = expert-TP x EP x expert-DP)."""
        return self.grid.expert_dp(self.tp * self.cp * self.dp * self.pp)

    @property
    def micro_batches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def schedule(self) -> str:
        return "zb-h1" if self.zero_bubble else "interleaved" if self.virtual_stages > 1 else "1f1b"

    def apply(self, run: RunSections) -> RunSections:
        """`run` with this layout's choices, each section checked as a run would check it (one ConfigError line)."""
        full = self.recompute == "full"  # --recompute-activations is selective: the layout says granularity
        model = dataclasses.replace(run.model, recompute_activations=False,
                                    recompute_granularity=None if self.recompute == "none" else self.recompute,
                                    recompute_method="uniform" if full else None,
                                    recompute_num_layers=1 if full else None, sequence_parallel=self.sequence_parallel,
                                    context_parallel_size=self.cp)
        zero = dataclasses.replace(run.zero, stage=self.stage, units=self.units)
        offload = dataclasses.replace(run.offload, optimizer=self.offload_optimizer, params=self.offload_params)
        if offload.uses_disk and not offload.path:  # the path only matters to a run; checked there
            offload = dataclasses.replace(offload, path="OFFLOAD_PATH")
        pipeline = dataclasses.replace(run.pipeline, size=self.pp, virtual_stages=self.virtual_stages,
                                       zero_bubble=self.zero_bubble)
        model.validate(self.tp)
        if model.num_experts:  # the MoE rules at this grid, as the model's build checks them
            check_moe(model, self.tp)
            check_expert_grid(model, self.ep, self.grid.expert_tp)
            self.grid.check(self.tp * self.cp * self.dp * self.pp)
            if offload.params == "disk" or offload.grads_tier(zero.stage) == "disk":  # make_stage's rule
                raise ConfigError("expert parameters are partitioned apart from the dense ones: no disk tier for "
                                  "parameters or gradients")
        zero.validate()
        check_zero_units(zero, model.torch_compile, model.cuda_graph_impl)
        offload.validate(zero.stage)
        check_composition(pipeline, zero.stage, model.cuda_graph_impl)
        if pipeline.zero_bubble and model.fp8_format is not None:
            raise ConfigError("--fp8-format linears cannot defer their weight gradients to zero bubble's W pass")
        if pipeline != PipelineConfig():
            pipeline.validate(model.num_layers, self.micro_batches)
        return dataclasses.replace(run, model=model, zero=zero, offload=offload, pipeline=pipeline)

    def describe(self) -> str:
        offload = "" if self.offload_optimizer == "none" else (
            f", optimizer on {self.offload_optimizer}" + (f", params on {self.offload_params}"
                                                          if self.offload_params != "none" else ""))
        sp = " + SP" if self.sequence_parallel else ""
        units = ", linear units" if self.units == "linear" else ""
        ep = "" if self.ep == 1 and self.expert_tp is None else f" (experts: EP {self.ep}" + (
            f", expert-TP {self.expert_tp}" if self.expert_tp is not None else "") + f", expert-DP {self.expert_dp})"
        cp = f" x CP {self.cp}" if self.cp > 1 else ""
        pp = "" if self.pp == 1 else f" x PP {self.pp} ({self.schedule}" + (
            f", v {self.virtual_stages})" if self.virtual_stages > 1 else ")")
        return (f"TP {self.tp}{cp}{pp} x DP {self.dp}{ep}, ZeRO-{self.stage}{units}{offload}, recompute "
                f"{self.recompute}{sp}, "
                f"micro-batch {self.micro_batch} x {self.micro_batches}")


@dataclass(frozen=True)
class Machine:
    world_size: int
    device_memory: float  # bytes per device
    host_memory: float | None = None  # bytes per node; None: not checked
    disk_space: float | None = None  # bytes per node; None: no disk tier
    device_reserve: float = 0.0  # bytes per device kept free (CUDA context, allocator slack)
    cuda: bool = True  # the device is a GPU; False: the CPU (device and host are one memory)
    hardware: Hardware = field(default_factory=Hardware)

    @property
    def ranks_per_node(self) -> int:
        return min(self.hardware.gpus_per_node, self.world_size)


@dataclass(frozen=True)
class LayoutPlan:
    layout: Layout
    states: StatePlan
    activations: ActivationPlan | None  # None: not counted (no activation-memory module for this setting)
    tp_comm: float  # bytes per rank per iteration on the TP group
    cost: Cost
    construction: int  # device bytes at the high-water mark of building the model and optimizer
    transients: dict  # working tensors of a step, by term (transients.compute_transients)
    device_peak: int  # max(construction, backward, optimizer step)
    host_per_rank: int
    host_per_node: int
    disk_per_node: int
    fits: bool
    why: str  # what does not fit ("" when it fits)
    cp_comm: float = 0.0  # bytes per rank per iteration on the CP group (mpzero.context_parallel.cp_comm_theory)
    pp_comm: float = 0.0  # bytes per rank per iteration on the pipeline and embedding groups (the deciding rank's)
    pp_rank: int = 0  # the pipeline rank whose figures these are: the largest device peak
    stage_peaks: tuple[int, ...] = ()  # every pipeline rank's device peak
    ep_comm: float = 0.0  # bytes per rank per iteration on the EP group at balanced routing (planner.experts)

    @property
    def backward_peak(self) -> int:
        """States + the in-step buffers + activations + the largest backward working tensor (an upper bound: they
        peak at nearby moments of backward)."""
        t = self.transients
        acts = self.activations.peak if self.activations is not None else 0
        return (self.states.device + self.states.working_set + acts
                + max(t["cross entropy"], t["vocabulary gradients"], t["attention backward"]))

    @property
    def step_peak(self) -> int:
        return self.states.device + self.transients["optimizer step"]

    def components(self) -> dict[str, int | None]:
        """Bytes per rank of each component (device unless named host/disk); the device peak is the largest of
        construction, backward (the sum of the five above it) and the optimizer step."""
        s, a, t = self.states, self.activations, self.transients
        return {"parameters": s.params, "gradients": s.grads, "optimizer states": s.optimizer,
                "gathered/buckets (in step)": s.working_set,
                "activations": None if a is None else a.peak,
                "working tensors": max(t["cross entropy"], t["vocabulary gradients"], t["attention backward"]),
                "optimizer step": t["optimizer step"], "construction": self.construction,
                "device peak": self.device_peak,
                "host states": s.host, "host buffers": s.host_buffers, "disk": s.disk}

    def to_json(self) -> dict:
        s = self.states
        return {"layout": dataclasses.asdict(self.layout), "micro_batches": self.layout.micro_batches,
                "fits": self.fits, "why": self.why, "bytes_per_rank": self.components(),
                "backward_peak": self.backward_peak, "step_peak": self.step_peak, "working_tensors": self.transients,
                "working_set_formula": s.working_text,
                "activation_formula": None if self.activations is None else self.activations.text,
                "activations_saved": None if self.activations is None else self.activations.saved,
                "host_per_node": self.host_per_node, "disk_per_node": self.disk_per_node,
                "model_state_formula": s.report.formula_text, "model_state_formula_bytes": s.report.formula,
                "dp_bytes_per_iter": s.comm_bytes, "dp_theory_bytes_per_iter": s.comm.theory,
                "tp_bytes_per_iter": self.tp_comm, "cp_bytes_per_iter": self.cp_comm,
                "pp_bytes_per_iter": self.pp_comm, "pipeline_rank": self.pp_rank,
                "ep_bytes_per_iter_balanced": self.ep_comm,
                "activation_routing": None if self.activations is None else self.activations.routing,
                "activations_balanced": None if self.activations is None else self.activations.balanced,
                "stage_peaks": list(self.stage_peaks),
                "activations_held": None if self.activations is None else self.activations.held,
                "transfers_per_iter": {t.name: t.theory for t in s.comm.transfers},
                "seconds_per_iter": self.cost.seconds, "tokens_per_s": self.cost.tokens_per_second,
                "cost": {"compute": self.cost.compute, "dp": self.cost.dp, "fetch": self.cost.fetch,
                         "tp": self.cost.tp, "cp": self.cost.cp, "offload": self.cost.offload, "pp": self.cost.pp,
                         "bubble": self.cost.bubble},
                "zero_memory_line": s.report.line(), "zero_comm_line": s.comm.line()}


RECOMPUTE_MODES = ("none", "selective", "full")


class Planner:
    """Evaluates layouts of the run `run` on `machine`; a mixture of experts' activations at `routing` ("worst":
    the dropless worst case or the capacity bound; "balanced": every expert its share, `planner.experts`)."""

    def __init__(self, run: RunSections, machine: Machine, routing: str = "worst"):
        self.run, self.machine, self.routing = run, machine, routing  # a mixture of experts' (planner.experts)
        self.precision = run.precision
        self.p, self.g = element_sizes(self.precision)
        self.seq = run.seq_length

    @functools.lru_cache(maxsize=None)
    def _activations(self, config, tp: int, micro_batch: int, stage=None, ep: int = 1,
                     etp: int | None = None) -> ActivationPlan | None:
        return activation_plan(config, tp, micro_batch, self.seq, self.precision.torch_dtype, self.machine.cuda,
                               stage=stage, ep=ep, etp=etp, routing=self.routing)

    def evaluate(self, layout: Layout) -> LayoutPlan:
        """The layout's plan: each pipeline rank's (ranks alike evaluated once), the largest device peak shown and
        deciding what fits, the slowest rank's cost."""
        run = layout.apply(self.run)
        stages = pipeline_stages(run.pipeline, run.model.num_layers)
        plans = [plan for stage, ranks in stage_classes(stages)
                 for plan in self._stage_plans(layout, run, stage, ranks)]
        worst = max(plans, key=lambda plan: plan.device_peak)
        slowest = max(plans, key=lambda plan: plan.cost.seconds)
        peaks = tuple(plan.device_peak for plan in sorted(plans, key=lambda plan: plan.pp_rank))
        return dataclasses.replace(worst, cost=slowest.cost, stage_peaks=peaks)

    def _stage_plans(self, layout: Layout, run: RunSections, stage, ranks: tuple[int, ...]) -> list[LayoutPlan]:
        """The plans of pipeline ranks `ranks`, which hold alike (`stage`, one of them; None: the whole model):
        the same model states, each its own micro-batches in flight and point-to-point bytes."""
        machine, hw = self.machine, self.machine.hardware
        config, zero, offload, rule = run.model, run.zero, run.offload, run.optimizer.rule
        etp = layout.grid.expert_tp
        shapes = model_shapes(normalized(config), layout.tp, stage, layout.ep, etp)
        zero_ranks = layout.dp * layout.cp  # parameters replicated over CP: ZeRO partitions over DP x CP
        expert_dp = (layout.expert_dp, 0)  # expert parameters over expert-DP (zero/families.py)
        states = plan_states(PlanInputs(shapes, zero, self.precision, zero_ranks, 0, offload, layout.micro_batches,
                                        cuda=self.machine.cuda, rule=rule,
                                        recomputed=full_recompute_chunks(config), expert_dp=expert_dp))
        acts = self._activations(config, layout.tp, layout.micro_batch, stage, layout.ep, etp)
        tp_comm = tp_comm_bytes(config, layout.tp, layout.micro_batch, self.seq, self.p, layout.micro_batches, stage,
                                etp)
        ep_comm = 0.0
        if acts is not None and acts.formula is not None and acts.formula.setting.moe is not None:
            ep_comm = ep_comm_bytes(acts.formula.setting, layout.micro_batches, recomputed_layers(config, stage))
        cp_comm = cp_comm_theory(config, layout.tp, layout.micro_batch, self.seq, self.p, layout.micro_batches,
                                 stage)[0]
        layouts = shapes.layouts(zero.stage, zero_ranks, 0, zero.bucket_numel, zero.units, expert_dp)
        construction = states.report.construction[0].measured  # streamed: the states + one unit's working set
        runs = [end - start for lay in layouts for start, end, _ in lay.decay_runs()]
        largest_shard = max((lay.shard_numel for lay in layouts), default=0)  # Fp32Buckets: a bucket, or sub-groups
        cast = step_fp32_bytes(offload.optimizer != "none", largest_shard, offload.sub_group_numel)[0] // 4
        first, last = (True, True) if stage is None else (stage.first, stage.last)
        transients = compute_transients(config, layout.tp, layout.micro_batch, self.seq, self.p, self.g, cast,
                                        max(runs, default=0), machine.cuda, self.precision.dtype == "fp16",
                                        first, last)
        working = max(transients["cross entropy"], transients["vocabulary gradients"],
                      transients["attention backward"])
        pipe = run.pipeline.pipe(layout.micro_batches)
        share = 1.0 if stage is None else sum(len(c) for c in stage.chunks) * layout.pp / config.num_layers
        bubble = bubble_fraction(layout.schedule, layout.pp, layout.virtual_stages, layout.micro_batches,
                                 config.hidden_size, self.seq)
        activation_bytes = hidden_state_bytes(config, layout.tp, layout.micro_batch, self.seq, self.p)
        tied = tied_bytes(layouts, self.g)
        plans = []
        for rank in ranks:
            held = acts
            if acts is not None and stage is not None:
                held = dataclasses.replace(acts, **dict(zip(("in_flight", "in_flight_text"), in_flight_bytes(
                    layout.schedule, pipe, rank, acts.formula))))
            pp_comm = pipeline_comm_bytes(pipe, rank, activation_bytes, tied)
            cost = layout_cost(config, layout, states, hw, machine.world_size, tp_comm, self.p, machine.cuda,
                               cp_comm, pp_comm, share, bubble, ep_comm)
            device_peak = max(construction, states.device + transients["optimizer step"],
                              states.device_peak + (held.peak if held is not None else 0) + working)
            plans.append(dataclasses.replace(self._fitting(
                layout, states, held, tp_comm, cost, construction, transients, device_peak, (cp_comm, pp_comm), rank),
                ep_comm=ep_comm))
        return plans

    def _fitting(self, layout, states, acts, tp_comm, cost, construction, transients, device_peak, comm,
                 rank) -> LayoutPlan:
        """The plan of one pipeline rank and whether it fits the machine; `comm`: its (CP, pipeline) bytes."""
        machine = self.machine
        host_per_rank = states.host + states.host_buffers + (acts.host if acts is not None else 0)
        host_per_node = machine.ranks_per_node * host_per_rank
        disk_per_node = machine.ranks_per_node * states.disk
        why = []
        if device_peak + machine.device_reserve > machine.device_memory:
            why.append("device")
        if machine.host_memory is not None and host_per_node > machine.host_memory:
            why.append("host")
        if states.disk and (machine.disk_space is None or disk_per_node > machine.disk_space):
            why.append("disk")
        return LayoutPlan(layout, states, acts, tp_comm, cost, construction, transients, device_peak, host_per_rank,
                          host_per_node, disk_per_node, not why, ",".join(why), *comm, rank)

    def layouts(self, tps=None, stages=None, tiers=None, recompute=None, micro_batches=None,
                max_micro_batch: int = 64, units=None, pps=None, virtual=None, zero_bubble=None,
                cps=(1,), eps=None, expert_tps=None) -> list[Layout]:
        """Every layout of the world: TP in the divisors of the head count that divide the world, pipeline sizes
        (`pps`, default every one that divides the rest) with their schedules (1F1B; interleaved with each of
        `virtual`, default 2; ZB-H1 unless `zero_bubble` is (False,)), ZeRO stages, offload tiers allowed at
        each stage (disk only with disk space), stage 3's units (`units`, default both), recomputation modes,
        micro-batch sizes (powers of two, or the given ones) that divide the global batch's share of a DP rank
        (without --global-batch-size: the global batch is micro-batch x DP, as in pretrain_gpt.py). What the
        run's own checks refuse is left out: linear units with --torch-compile, stage 3 with CUDA graphs, a
        pipeline's layer split or micro-batches against Megatron's rules, ZeRO-3 with a pipeline. `cps`: the
        context-parallel sizes to try (the sequence must divide by 2·CP; a2a splits each TP rank's heads and groups
        over CP). A mixture of experts: EP sizes (`eps`, default every divisor of the expert count the folded grid
        takes) and expert-TP (`expert_tps`, default TP and, at TP > 1, 1; 0 stands for TP), sequence parallelism
        at TP > 1 (MoE's rule); a dense model keeps EP 1."""
        model = self.run.model
        world, heads = self.machine.world_size, model.num_attention_heads
        tps = [t for t in (tps or range(1, world + 1)) if world % t == 0 and heads % t == 0]
        stages = [s for s in (stages if stages is not None else (0, 1, 2, 3))
                  if s < 3 or model.cuda_graph_impl == "none"]
        tiers = [t for t in (tiers or TIERS) if t != "disk" or self.machine.disk_space is not None]
        modes = [m for m in (recompute or RECOMPUTE_MODES) if m in RECOMPUTE_MODES]
        sizes = micro_batches or [1 << k for k in range(max_micro_batch.bit_length()) if 1 << k <= max_micro_batch]
        unit_kinds = units or (("layer",) if model.torch_compile else ZERO_UNITS)
        out = []
        for tp, cp, pp, stage in itertools.product(tps, cps, pps or range(1, world + 1), stages):
            if world % (tp * cp * pp) or not context_fits(model, self.seq, tp, cp):
                continue
            dp = world // (tp * cp * pp)
            sps = (False, True) if tp > 1 and (self.seq // cp) % tp == 0 else (False,)
            if model.num_experts and tp > 1:
                sps = (True,) if (self.seq // cp) % tp == 0 else ()
            for (optimizer, params), kind, mode, sp, mbs, (v, zb), (ep, etp) in itertools.product(
                    offloads(stage, tiers), unit_kinds if stage == 3 else ("layer",), modes, sps, sizes,
                    schedules(pp, virtual, zero_bubble), expert_grids(model, tp, eps, expert_tps)):
                gbs = self.run.global_batch_size or mbs * dp
                layout = Layout(tp, dp, stage, mbs, gbs, optimizer, params, mode, sp, kind, cp, pp, v, zb, ep, etp)
                if gbs % (mbs * dp) == 0 and (pp == 1 and not model.num_experts or self._pipeline_runs(layout)):
                    out.append(layout)
        return out

    def _pipeline_runs(self, layout: Layout) -> bool:
        """Whether a run takes the layout's pipeline (layer split, micro-batches, ZeRO stage: its own checks)."""
        try:
            layout.apply(self.run)
        except ConfigError:
            return False
        return True


def rank_plans(plans: list[LayoutPlan]) -> list[LayoutPlan]:
    """Layouts that fit, fastest first (then the least device memory); the rest after, smallest overflow first."""
    fitting = sorted((p for p in plans if p.fits), key=lambda p: (-p.cost.tokens_per_second, p.device_peak))
    others = sorted((p for p in plans if not p.fits), key=lambda p: p.device_peak)
    return fitting + others
