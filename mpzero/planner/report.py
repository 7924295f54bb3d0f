"""The planner's output: a table of layouts, their components per rank, and the command of the best one."""

from __future__ import annotations

import shlex

from mpzero.planner.plan import Layout, LayoutPlan, Machine

GIB = 2 ** 30

# flags a layout sets (and the number of values each takes): removed from the user's command line before the
# layout's own are added
LAYOUT_FLAGS = {"--tensor-model-parallel-size": 1, "--zero-stage": 1, "--micro-batch-size": 1,
                "--global-batch-size": 1, "--offload-optimizer": 1, "--optimizer-cpu-offload": 0,
                "--offload-params": 1, "--recompute-activations": 0, "--recompute-granularity": 1,
                "--recompute-method": 1, "--recompute-num-layers": 1, "--sequence-parallel": 0, "--zero-units": 1,
                "--context-parallel-size": 1, "--pipeline-model-parallel-size": 1,
                "--num-virtual-stages-per-pipeline-rank": 1, "--num-layers-per-virtual-pipeline-stage": 1,
                "--enable-zero-bubble": 0, "--expert-model-parallel-size": 1, "--expert-tensor-parallel-size": 1}


def gib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / GIB:.2f}"


def layout_argv(layout: Layout, offload_path: str | None) -> list[str]:
    argv = ["--tensor-model-parallel-size", str(layout.tp)] + (
        ["--context-parallel-size", str(layout.cp)] if layout.cp > 1 else []) + ["--zero-stage", str(layout.stage),
            "--micro-batch-size", str(layout.micro_batch), "--global-batch-size", str(layout.global_batch)]
    if layout.pp > 1:
        argv += ["--pipeline-model-parallel-size", str(layout.pp)]
    if layout.virtual_stages > 1:
        argv += ["--num-virtual-stages-per-pipeline-rank", str(layout.virtual_stages)]
    if layout.zero_bubble:
        argv += ["--enable-zero-bubble"]
    if layout.ep > 1:
        argv += ["--expert-model-parallel-size", str(layout.ep)]
    if layout.expert_tp is not None:
        argv += ["--expert-tensor-parallel-size", str(layout.expert_tp)]
    if layout.recompute == "full":  # (--recompute-activations is Megatron's selective recomputation)
        argv += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif layout.recompute == "selective":
        argv += ["--recompute-granularity", "selective"]
    if layout.sequence_parallel:
        argv += ["--sequence-parallel"]
    if layout.units != "layer":
        argv += ["--zero-units", layout.units]
    if layout.offload_optimizer != "none":
        argv += ["--offload-optimizer", layout.offload_optimizer]
    if layout.offload_params != "none":
        argv += ["--offload-params", layout.offload_params]
    if "disk" in (layout.offload_optimizer, layout.offload_params):
        argv += ["--offload-path", offload_path or "/nvme/mpzero-swap"]
    return argv


def without_layout_flags(argv: list[str]) -> list[str]:
    out, skip = [], 0
    for token in argv:
        if skip:
            skip -= 1
            continue
        name = token.split("=", 1)[0]
        if name in LAYOUT_FLAGS:
            skip = LAYOUT_FLAGS[name] if "=" not in token else 0
            continue
        if name == "--offload-path":
            skip = 0 if "=" in token else 1
            continue
        out.append(token)
    return out


def torchrun_command(user_argv: list[str], layout: Layout, machine: Machine, offload_path: str | None) -> str:
    per_node = machine.ranks_per_node
    nodes = machine.world_size // per_node
    launcher = ["torchrun"] + (["--nnodes", str(nodes)] if nodes > 1 else []) + ["--nproc-per-node", str(per_node)]
    if nodes > 1:
        launcher += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "HOST:29500", "--rdzv-id", "JOB"]
    argv = without_layout_flags(user_argv) + layout_argv(layout, offload_path)
    return shlex.join(launcher + ["pretrain_gpt.py"] + argv)


HEADER = ("  #  TP CP  PP(sched)   DP  ZeRO  offload(opt/par)  recompute  mbs x m   params  grads  optim  in-step  "
          "activ   work  build | device peak  host/node   disk/node | DP GB/it  TP GB/it  CP GB/it  PP GB/it |   "
          "s/iter  tokens/s  fits")
_SCHEDULE = {"1f1b": "", "interleaved": "i", "zb-h1": "zb"}
_DP_COLUMN = "   DP  ZeRO"


def header(experts: bool = False) -> str:
    """The table's header; `experts`: with the EP and expert-TP column (a mixture of experts)."""
    return HEADER.replace(_DP_COLUMN, "   DP  EP/eTP  ZeRO") if experts else HEADER


def row(i: int, plan: LayoutPlan, experts: bool = False) -> str:
    lay, c = plan.layout, plan.components()
    recompute = lay.recompute + ("+SP" if lay.sequence_parallel else "")
    offload = f"{lay.offload_optimizer}/{lay.offload_params}"
    v = lay.virtual_stages if lay.virtual_stages > 1 else ""
    schedule = "" if lay.pp == 1 else f"{_SCHEDULE[lay.schedule]}{v}"
    pp = f"{lay.pp}{f'({schedule})' if schedule else ''}"
    grid = f"  {f'{lay.ep}/{lay.expert_tp or lay.tp}':>6}" if experts else ""
    return (f"{i:>3}  {lay.tp:>2} {lay.cp:>2}  {pp:>9} {lay.dp:>4}{grid}  {lay.stage:>4}  {offload:>16}  "
            f"{recompute:>9}  "
            f"{lay.micro_batch:>3} x {lay.micro_batches:<3} {gib(c['parameters']):>7} {gib(c['gradients']):>6} "
            f"{gib(c['optimizer states']):>6} {gib(c['gathered/buckets (in step)']):>8} "
            f"{gib(c['activations']):>6} {gib(c['working tensors']):>6} {gib(c['construction']):>6} "
            f"| {gib(plan.device_peak):>11} {gib(plan.host_per_node):>10} "
            f"{gib(plan.disk_per_node):>11} | {plan.states.comm_bytes / 1e9:>8.2f} {plan.tp_comm / 1e9:>9.2f} "
            f"{plan.cp_comm / 1e9:>9.2f} {plan.pp_comm / 1e9:>9.2f} | "
            f"{plan.cost.seconds:>8.3f} {plan.cost.tokens_per_second:>9.0f}  "
            f"{'yes' if plan.fits else 'no: ' + plan.why}")


def components_text(plan: LayoutPlan) -> list[str]:
    s, a = plan.states, plan.activations
    lines = [f"  parameters        {gib(s.params):>9} GiB",
             f"  gradients         {gib(s.grads):>9} GiB",
             f"  optimizer states  {gib(s.optimizer):>9} GiB   (formula {s.report.formula_text}: "
             f"{gib(s.report.formula)} GiB for all three, padding {s.padding} elements)",
             f"  in-step buffers   {gib(s.working_set):>9} GiB   ({s.working_text}: gathered units, prefetch, "
             f"gradient buckets in flight)"]
    if a is None:
        lines.append("  activations               -       (not counted: no activation-memory formula for this setting)")
    else:
        held = "" if a.in_flight is None else (f"held in flight {gib(a.in_flight)} GiB = {a.in_flight_text} of "
                                                 f"micro-batches of {gib(a.saved)} GiB")
        lines.append(f"  activations       {gib(a.peak):>9} GiB   ({held or f'saved {gib(a.saved)} GiB'} + one "
                     f"recomputed layer {gib(a.recompute_transient)} GiB; per layer: {a.text})")
    t = plan.transients
    work = max(t["cross entropy"], t["vocabulary gradients"], t["attention backward"])
    lines += [f"  working tensors   {gib(work):>9} GiB   (largest of cross entropy {gib(t['cross entropy'])}, "
              f"vocabulary gradients "
              f"{gib(t['vocabulary gradients'])}, attention backward {gib(t['attention backward'])}; estimate)",
              f"  construction      {gib(plan.construction):>9} GiB   (model states + one unit's working set while made)",
              f"  device peak       {gib(plan.device_peak):>9} GiB   (largest of construction, backward "
              f"{gib(plan.backward_peak)}, optimizer step {gib(plan.step_peak)})",
              f"  host              {gib(plan.host_per_rank):>9} GiB per rank (states {gib(s.host)}, buffers "
              f"{gib(s.host_buffers)}), {gib(plan.host_per_node)} GiB per node",
              f"  disk              {gib(s.disk):>9} GiB per rank, {gib(plan.disk_per_node)} GiB per node",
              f"  DP traffic        {s.comm_bytes / 1e9:>9.3f} GB per rank per iteration (theory "
              f"{s.comm.theory_text} = {s.comm.theory / 1e9:.3f} GB)",
              f"  TP traffic        {plan.tp_comm / 1e9:>9.3f} GB per rank per iteration"]
    if a is not None and a.routing:
        lines.append(f"  experts           {a.routing}: activations saved {gib(a.balanced)} GiB a micro-batch at "
                     f"balanced routing, {gib(a.saved)} GiB as planned; EP traffic {plan.ep_comm / 1e9:.3f} GB per "
                     f"rank per iteration at balanced routing")
    if plan.layout.cp > 1:
        lines.append(f"  CP traffic        {plan.cp_comm / 1e9:>9.3f} GB per rank per iteration (CP {plan.layout.cp})")
    if plan.layout.pp > 1:
        peaks = ", ".join(gib(peak) for peak in plan.stage_peaks)
        lines += [f"  pipeline          {plan.pp_comm / 1e9:>9.3f} GB per rank per iteration point-to-point "
                  f"(pipeline rank {plan.pp_rank}, the largest device peak of [{peaks}] GiB)"]
    for t in s.comm.transfers:
        if t.theory:
            lines.append(f"  {t.name:<17} {t.theory / 1e9:>9.3f} GB per rank per iteration ({t.theory_text})")
    cost = plan.cost
    pipeline = plan.layout.pp > 1
    lines.append(f"  cost              {cost.seconds:.3f} s/iteration = max(compute {cost.compute:.3f}"
                 + (f" x (1 + bubble {cost.bubble:.3f})" if pipeline else "") + f", DP "
                 f"{cost.dp:.3f}, fetch {cost.fetch:.3f}) + TP {cost.tp:.3f}"
                 + (f" + CP {cost.cp:.3f}" if plan.layout.cp > 1 else "") + (f" + PP {cost.pp:.3f}" if pipeline else "")
                 + (f" + EP {cost.ep:.3f}" if cost.ep else "")
                 + f" + offloaded step {cost.offload:.3f}; {cost.tokens_per_second:.0f} tokens/s")
    return lines
