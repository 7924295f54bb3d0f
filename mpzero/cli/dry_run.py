"""`pretrain_gpt.py --dry-run --world-size N --rank R ...`: rank R of an N-rank job, in one process, on fake
tensors and a fake process group. Nothing is allocated and no GPU is needed.

The run builds the real model and the real ZeRO optimizer for that rank (the same `build_training_state` as
training), runs two iterations of the real forward/backward/step code (every micro-batch of one global batch,
on mock tokens; stage 3 prefetches from the second on, from the trace the first records) and prints the lines a
real run prints at start and after an iteration, of the second: `zero memory` (model states against their
formula; stage 3 with its in-step peak), `zero comm` (DP bytes per iteration against theory). Then it prints
what the planner (`mpzero.planner`, `tools/plan_memory.py`) predicts for the same layout and whether every
figure is equal: model states, the peak, DP and TP communication, and the activation bytes (the `activation
memory` line's count, from the activation-memory module). A pipeline rank builds its own stage and runs two
iterations of its schedule (its transfers posted to the fake group: nothing arrives, the buffers stay without
data); it adds the micro-batches it held at once and the `pipeline comm` line (its point-to-point bytes and the
tied embedding's all-reduce).

How: `torch.distributed.init_process_group("fake", rank=R, world_size=N)` (torch's fake backend: collectives
return at once and move nothing; the bytes `CommGroup` counts are the real ones) and tensors without data
(`mpzero.planner.fake`: shapes, dtypes and storages, no memory): meta tensors, or torch's `FakeTensorMode` when a
tier is offloaded to host memory (its tensors report the CPU device, as the offload code expects). A scalar read
from them is 0: the loss and the gradient norm are 0. The run simulates the CPU device type (device<->host traffic
is zero, CPU activation terms; `tools/plan_memory.py --device cpu` prints these figures, its default plans a GPU).
The disk offload tier would write files: refused here, planned by the planner.

A mixture of experts routes by the data, and these tensors hold none: the dry run states a routing, balanced (slot
i of a rank's D k slots to expert i mod E, `mpzero.moe.balanced_routing`, used only here), runs the real dispatch,
experts and ZeRO code on its split sizes, prints `moe routing` and `moe comm` (EP bytes against the planner's at that
routing), and compares the activations at it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import resource
import time

import torch
import torch.distributed as dist

from mpzero.activations import SavedBytesCounter, activation_formula, activation_line, modeled, rank_report
from mpzero.context_parallel import cp_comm_line, cp_comm_theory
from mpzero.errors import ConfigError
from mpzero.moe import balanced_routing
from mpzero.pipeline import in_flight_report, pipeline_schedule
from mpzero.planner import (ActivationPlan, PlanInputs, StatePlan, activation_plan, activation_setting,
                            element_sizes, engine_device, ep_comm_bytes, plan_moe_shape, recomputed_layers,
                            full_recompute_chunks, hidden_state_bytes, in_flight_bytes, model_shapes, no_data,
                            normalized, pipeline_comm_bytes, pipeline_stages, plan_states, tied_bytes, tp_comm_bytes)
from mpzero.tensor_parallel import seed_everything
from mpzero.training import (MockGPTDataset, RunConfig, TrainingState, build_training_state, forward_backward,
                             num_micro_batches, overlap_note, partition_note)
from mpzero.zero import ZeroOptimizer


def check_flags(args: argparse.Namespace) -> None:
    """--world-size/--rank belong to --dry-run; the rank lies in the world; no disk tier (it would write files); no
    torch.compile (it cannot compile tensors without data); no capacity below the balanced routing it states."""
    if not args.dry_run:
        if args.world_size is not None or args.rank is not None:
            raise ConfigError("--world-size and --rank describe the job a --dry-run simulates: add --dry-run (a real "
                              "run takes its world from torchrun)")
        return
    factor = args.moe_expert_capacity_factor
    if args.num_experts and factor is not None and factor < 1:
        raise ConfigError(f"--dry-run routes every expert its balanced share, which --moe-expert-capacity-factor "
                          f"{factor} would cut: dry-run a factor of 1 or more (or none), or plan this one with "
                          f"tools/plan_memory.py")
    world, rank = args.world_size or 1, args.rank or 0
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"--dry-run --rank {rank} must lie in [0, --world-size {world})")
    if "disk" in (args.offload_optimizer, args.offload_params):
        raise ConfigError("--dry-run keeps every tier in memory without data, and the disk tier would write real "
                          "files: plan disk offload with tools/plan_memory.py, or dry-run --offload-* cpu")
    for flag, given in (("--torch-compile", args.torch_compile),
                        ("--cross-entropy-loss-fusion", args.cross_entropy_loss_fusion)):
        if given:
            raise ConfigError(f"--dry-run runs on tensors without data, which torch.compile does not compile: drop "
                              f"{flag} from the dry run (compiling changes no parameter, gradient or optimizer byte)")


def dry_run(run: RunConfig, provider, world_size: int, rank: int, engine: str | None = None) -> dict:
    """Rank `rank` of a `world_size`-rank job: two iterations on tensors without data (`engine` "meta" or "fake";
    by default fake where a tier is offloaded to host memory, else meta), the run's lines
    and the planner's; a mixture of experts routed balanced (`mpzero.moe.balanced_routing`).
    Returns {"memory", "memory_at_start", "comm", "tp_comm", "activations", "plan", "plan_tp_comm",
    "plan_activations", "checks", "equal", "max_rss", "seconds"}."""
    start = time.perf_counter()
    if dist.is_initialized():
        raise ConfigError("--dry-run makes its own (fake) process group: run it as plain python, not under torchrun "
                          "or inside a process that already has one")
    if engine is None:  # an offload tier's device<->host copies are the CPU's only on fake tensors (planner.fake)
        engine = "fake" if run.offload.enabled else "meta"
    dist.init_process_group("fake", rank=rank, world_size=world_size)  # torch supplies its FakeStore
    groups = run.parallel.join()
    training = run.training
    micro_batches = num_micro_batches(training.global_batch_size, training.micro_batch_size, groups.dp_size)
    print(f"dry run: rank {rank} of {world_size} ({_grid(run, groups)}), {micro_batches} micro-batch(es) of "
          f"{training.micro_batch_size} x {training.seq_length} tokens, on {engine} tensors and a fake process group",
          flush=True)
    with balanced_routing() if run.model.num_experts else contextlib.nullcontext():
        state, at_start, memory, comm, (tp_comm, cp_comm, ep_comm), pipeline_comm, counter = _two_iterations(
            run, provider, groups, engine)
    print(memory.line(), flush=True)
    print(comm.line(), flush=True)
    cp_check = _context_parallel(run, groups, micro_batches, cp_comm)
    pp_comm = 0.0
    if pipeline_comm is not None:
        print(pipeline_comm.line(), flush=True)
        pp_comm = pipeline_comm.measured
    dtype = run.precision.torch_dtype  # the line training prints after its first iteration, here for this rank
    setting = state.model.module.activation_setting(training.micro_batch_size, training.seq_length, dtype,
                                                    groups.device)
    held = None
    if state.pipeline is not None:
        held = in_flight_report(state.pipeline, counter, None if modeled(setting) else activation_formula(setting))
    activations = rank_report(counter, setting, held)
    print(activation_line(rank, activations, dtype), flush=True)

    plan, plan_tp, plan_acts, plan_pp = _planned(run, groups, micro_batches)
    checks = compare(memory, comm, tp_comm, plan, plan_tp, activations, plan_acts, pp_comm, plan_pp) + cp_check
    checks += _experts(run, groups, micro_batches, ep_comm, plan_acts)
    equal = all(_same(a, b) for _, a, b in checks)
    print("planner | " + " | ".join(f"{name} {mine:.0f} vs {theirs:.0f}" for name, mine, theirs in checks)
          + f" | {'equal' if equal else 'DIFFERENT'}", flush=True)
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seconds = time.perf_counter() - start
    print(f"dry run | peak RSS {max_rss / 2**20:.0f} MiB | {seconds:.1f} s", flush=True)
    return {"memory": memory, "memory_at_start": at_start, "comm": comm, "tp_comm": tp_comm, "pp_comm": pp_comm,
            "activations": activations, "plan": plan, "plan_tp_comm": plan_tp, "plan_activations": plan_acts,
            "plan_pp_comm": plan_pp, "checks": checks, "equal": equal, "max_rss": max_rss, "seconds": seconds}


def _grid(run: RunConfig, groups) -> str:
    """This rank's place in the grid, as the first line says it."""
    cp = f" x CP {groups.cp.size}" if groups.cp.size > 1 else ""
    pp = f" x PP {groups.pp_size} ({run.pipeline.schedule})" if groups.pp_size > 1 else ""
    ranks = [f"TP rank {groups.tp_rank}"] + ([f"CP rank {groups.cp.rank}"] if cp else []) + (
        [f"pipeline rank {groups.pp_rank}"] if pp else []) + [f"DP rank {groups.dp_rank}"]
    return f"TP {groups.tp_size}{cp}{pp} x DP {groups.dp_size}: {', '.join(ranks)}"


def _context_parallel(run: RunConfig, groups, micro_batches: int, cp_comm: float) -> list:
    """With context parallelism: the `cp comm` line printed, and its check against the theory (else none)."""
    if groups.cp.size == 1:
        return []
    training, p = run.training, element_sizes(run.precision)[0]
    stage = pipeline_stages(run.pipeline, run.model.num_layers)[groups.pp_rank]  # None without a pipeline
    print(cp_comm_line(run.model, groups.tp_size, training.micro_batch_size, training.seq_length, p, micro_batches,
                       cp_comm, stage), flush=True)
    theory = cp_comm_theory(run.model, groups.tp_size, training.micro_batch_size, training.seq_length, p,
                            micro_batches, stage)[0]
    return [("CP bytes/iter", cp_comm, theory)]


def _experts(run: RunConfig, groups, micro_batches: int, ep_comm: float, plan_acts) -> list:
    """With experts: the routing stated (balanced, the dry run's own: its tensors hold no data to route by), the
    `moe comm` line's EP bytes against the planner's at that routing (else none)."""
    if not run.model.num_experts:
        return []
    training = run.training
    stage = pipeline_stages(run.pipeline, run.model.num_layers)[groups.pp_rank]
    setting = activation_setting(run.model, groups.tp_size, groups.tp_rank, training.micro_batch_size,
                                 training.seq_length, run.precision.torch_dtype, False)
    setting = dataclasses.replace(setting, moe=plan_moe_shape(run.model, groups.tp_size, groups.ep.size,
                                                              groups.expert_tp.size))
    if stage is not None:
        setting = setting.for_stage(stage.chunks, stage.first, stage.last)
    theory = ep_comm_bytes(setting, micro_batches, recomputed_layers(run.model, stage), groups.ep.rank)
    routing = plan_acts.routing if plan_acts is not None else ""
    print(f"moe routing | the dry run routes balanced: slot i of a rank's D k slots to expert i mod E, every expert "
          f"its share (a stated routing: its tensors hold no data to route by) | {routing}", flush=True)
    print(f"moe comm | ep {groups.ep.size} | dispatcher {run.model.moe_token_dispatcher_type} | measured bytes/iter "
          f"{ep_comm:.0f} | theory at balanced routing bytes/iter {theory:.0f}", flush=True)
    return [("EP bytes/iter", ep_comm, theory)]


def _two_iterations(run: RunConfig, provider, groups, engine: str) -> tuple:
    """The training state built on tensors without data and two iterations, the second measured (stage 3 prefetches
    from the trace its first micro-batch records): (state, memory report at start, memory report, comm report, (TP
    bytes, CP bytes), the `pipeline comm` report (None without a pipeline), the second iteration's
    SavedBytesCounter)."""
    training = run.training
    with no_data(engine):
        state = _build(run, provider, groups, engine)
        optimizer = state.optimizer
        at_start = optimizer.memory_report()
        print(at_start.line(), flush=True)
        for note in (overlap_note(optimizer), partition_note(optimizer)):
            if note:
                print(note, flush=True)
        data = MockGPTDataset(run.data.vocab_size, training.seq_length, training.seed,
                              2 * training.global_batch_size)
        forward_backward(state, data, 0, training)
        optimizer.step(run.schedule.lr(0))
        optimizer.comm_report()  # count from the second iteration on
        meter = state.pipeline.meter if state.pipeline is not None else None
        if meter is not None:
            meter.report(1)
        tp_mark, cp_mark, ep_mark = groups.tp.stats.total(), groups.cp.stats.total(), groups.ep.stats.total()
        counter = SavedBytesCounter(state.model.module)
        forward_backward(state, data, 1, training, activations=counter)
        cp_comm, ep_comm = groups.cp.stats.total() - cp_mark, groups.ep.stats.total() - ep_mark
        optimizer.step(run.schedule.lr(1))
        memory, comm = optimizer.memory_report(), optimizer.comm_report()
        tp_comm = groups.tp.stats.total() - tp_mark
        pipeline_comm = meter.report(2) if meter is not None else None
        optimizer.close()
    return state, at_start, memory, comm, (tp_comm, cp_comm, ep_comm), pipeline_comm, counter


def _planned(run: RunConfig, groups, micro_batches: int) -> tuple:
    """The planner's figures for this rank (a pipeline rank: its stage), from the flags alone: (model states plan,
    TP bytes, activation plan with the micro-batches in flight, pipeline bytes)."""
    training, (p, g) = run.training, element_sizes(run.precision)
    stage = pipeline_stages(run.pipeline, run.model.num_layers)[groups.pp_rank]
    shapes = model_shapes(normalized(run.model), groups.tp_size, stage, groups.ep.size, groups.expert_tp.size)
    zero_group = groups.dp_cp  # ZeRO partitions over DP x CP (expert parameters over expert-DP)
    expert_dp = (groups.expert_dp.size, groups.expert_dp.rank)
    plan = plan_states(PlanInputs(shapes, run.zero, run.precision, zero_group.size, zero_group.rank, run.offload,
                                  micro_batches, cuda=False, rule=run.optimizer.rule,
                                  recomputed=full_recompute_chunks(run.model), expert_dp=expert_dp))
    plan_tp = tp_comm_bytes(run.model, groups.tp_size, training.micro_batch_size, training.seq_length, p,
                            micro_batches, stage, groups.expert_tp.size)
    plan_acts = activation_plan(run.model, groups.tp_size, training.micro_batch_size, training.seq_length,
                                run.precision.torch_dtype, cuda=False, tp_rank=groups.tp_rank, stage=stage,
                                ep=groups.ep.size, etp=groups.expert_tp.size, ep_rank=groups.ep.rank,
                                routing="balanced")
    plan_pp = 0.0
    if stage is not None:
        pipe, zero = run.pipeline.pipe(micro_batches), run.zero
        if plan_acts is not None:
            plan_acts = dataclasses.replace(plan_acts, **dict(zip(("in_flight", "in_flight_text"), in_flight_bytes(
                run.pipeline.schedule, pipe, groups.pp_rank, plan_acts.formula))))
        layouts = shapes.layouts(zero.stage, zero_group.size, zero_group.rank, zero.bucket_numel, zero.units,
                                 expert_dp)
        activation_bytes = hidden_state_bytes(run.model, groups.tp_size, training.micro_batch_size,
                                              training.seq_length, p)
        plan_pp = pipeline_comm_bytes(pipe, groups.pp_rank, activation_bytes, tied_bytes(layouts, g))
    return plan, plan_tp, plan_acts, plan_pp


def _build(run: RunConfig, provider, groups, engine: str) -> TrainingState:
    """The training state as `build_training_state` makes it; on meta tensors the model and optimizer are handed
    the meta device while the generators stay on the CPU (the meta device has none: nothing is drawn anyway)."""
    if engine == "fake":
        return build_training_state(run, provider, groups)
    groups = dataclasses.replace(groups, device=engine_device(engine))
    rng = seed_everything(run.training.seed, groups.tp_rank, torch.device("cpu"), groups.pp_rank)
    built = provider(run.model, groups, rng)
    optimizer = ZeroOptimizer(built.module, groups, run.zero, run.optimizer, run.precision, offload=run.offload)
    schedule = None
    if groups.pp_size > 1:
        training = run.training
        schedule = pipeline_schedule(run.pipeline, groups, built.module, training.micro_batch_size,
                                     training.seq_length, num_micro_batches(training.global_batch_size,
                                                                            training.micro_batch_size, groups.dp_size),
                                     run.precision.torch_dtype, optimizer.tied_gradient_bytes())
    return TrainingState(groups, built, optimizer, rng, schedule)


def compare(memory, comm, tp_comm: float, plan: StatePlan, plan_tp: float, activations: dict | None = None,
            plan_acts: ActivationPlan | None = None, pp_comm: float = 0.0,
            plan_pp: float = 0.0) -> list[tuple[str, float, float]]:
    """(figure, the dry run's, the planner's) for every figure both give."""
    checks = [("model-state bytes", memory.measured, plan.report.measured),
              ("formula bytes", memory.formula, plan.report.formula),
              ("DP bytes/iter", comm.measured, plan.comm.measured),
              ("TP bytes/iter", tp_comm, plan_tp)]
    if pp_comm or plan_pp:
        checks.append(("pipeline bytes/iter", pp_comm, plan_pp))
    if memory.peak is not None:
        checks.append(("peak bytes", memory.peak.measured, plan.report.peak.measured))
    for mine, theirs in zip(memory.construction, plan.report.construction):
        checks.append((f"{mine.name} bytes", mine.measured, theirs.measured))
    if activations is not None and plan_acts is not None:
        checks.append(("activation bytes", activations["total"], plan_acts.saved))
        held = activations.get("in flight")
        if held is not None and plan_acts.in_flight is not None:
            checks.append(("in-flight activation bytes", held.counted, plan_acts.in_flight))
    ours = {tier.name: tier for tier in plan.report.tiers}
    for tier in memory.tiers:
        if tier.name in ours:
            checks.append((f"{tier.name} bytes", tier.measured, ours[tier.name].measured))
    return checks


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.5)
