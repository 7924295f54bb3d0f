"""Will it fit? Every layout of a GPT run on N devices, the bytes per rank of each component, and the fastest
layout that fits, with its torchrun command.

    python tools/plan_memory.py --world-size 512 --device-memory 80GiB --host-memory 1TiB \
        --num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --vocab-size 51200 \
        --global-batch-size 1536 --bf16 [--json]

Takes pretrain_gpt.py's model and training flags (or --config FILE); --train-iters, --lr and --micro-batch-size
may be left out, data flags too (--vocab-size, default 50257, stands for the tokenizer). The layout flags
(TP size, pipeline size and schedule, ZeRO stage, offload tiers, recomputation, micro-batch) are what it chooses:
each is enumerated unless restricted (--tp-sizes, --pp-sizes, --virtual-stages, --zero-bubble, --zero-stages,
--offload-tiers, --recompute-modes, --micro-batch-sizes; context parallelism only where asked: --cp-sizes 1,2,4,
--context-parallel-size, --cp-comm-type; with --num-experts EP and expert-TP: --ep-sizes, the activations at the
dropless worst case or --moe-plan-routing balanced), and one given as pretrain_gpt.py's own flag
(--tensor-model-parallel-size 8, --pipeline-model-parallel-size 8, --enable-zero-bubble, --zero-stage 3,
--offload-optimizer cpu, --recompute-granularity full, --sequence-parallel, --micro-batch-size 2...) keeps only
the layouts with that value
(said in a note); the global batch is kept when given. Sizes take B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB; a bare number
is GiB. Every figure comes from the code's own functions (mpzero.planner): the `zero memory` and `zero comm`
lines it predicts are the lines the run prints, and `pretrain_gpt.py --dry-run` runs the real code for any rank
to confirm them (`--device cpu` gives the dry run's figures exactly).
"""

from __future__ import annotations

import argparse
import json
import sys


from mpzero.cli import Choice, Items, Number, Parser, Size, Text, exit_code
from mpzero.cli.arguments import build_parser, parse_args, planner_sections, tokenizer_record
from mpzero.cli.config_file import read_config_file
from mpzero.errors import ConfigError
from mpzero.pipeline import virtual_stages
from mpzero.planner.cost import Hardware
from mpzero.planner.plan import Machine, Planner, rank_plans
from mpzero.planner.report import GIB, components_text, header, row, torchrun_command

DEFAULTS = {"--micro-batch-size": "1", "--train-iters": "1", "--lr": "1e-4"}
# bytes per device for what the planner does not model: on cuda the context, NCCL's buffers and fragmentation; on
# cpu the libraries' code a run pages in (35.6 MiB of RssFile measured by bench_planner part 2, torch 2.13 CPU) and
# the allocator's and interpreter's slack (about 8 MiB more there)
DEFAULT_RESERVE = {"cuda": 2 * 2 ** 30, "cpu": 48 * 2 ** 20}


def planner_parser() -> argparse.ArgumentParser:
    p = Parser(prog="plan_memory.py", description=__doc__.split("\n\n")[0])
    m = p.add_argument_group("machine")
    m.add_argument("--world-size", type=Number(int, low=1), required=True, help="ranks (devices) of the job")
    m.add_argument("--device-memory", type=Size(), required=True, help="memory per device")
    m.add_argument("--host-memory", type=Size(), default=None, help="host memory per node (default: not checked)")
    m.add_argument("--disk-space", type=Size(), default=None,
                   help="disk space per node for the disk tier (default: no disk tier)")
    m.add_argument("--device-reserve", type=Size(low=0.0, low_ok=True), default=None,
                   help="memory per device kept free for what is not modeled: the CUDA context, NCCL buffers, "
                        "allocator fragmentation (default 2GiB on cuda; 48MiB on cpu: the code a run pages in, "
                        "allocator slack)")
    m.add_argument("--gpus-per-node", type=Number(int, low=1), default=8)
    m.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the device is host memory (no device<->host copies; CPU activation terms)")
    m.add_argument("--offload-path", type=Text(), default=None, help="where the disk tier goes in the printed command")
    c = p.add_argument_group("cost model (mpzero/planner/cost.py)")
    c.add_argument("--device-tflops", type=Number(float, low=0.0, low_ok=False), default=Hardware.device_tflops)
    c.add_argument("--efficiency", type=Number(float, low=0.0, low_ok=False, high=1.0, high_ok=True),
                   default=Hardware.efficiency)
    c.add_argument("--dp-bandwidth", type=Size(), default=Hardware.dp_bandwidth, help="per rank, e.g. 25GB")
    c.add_argument("--tp-bandwidth", type=Size(), default=Hardware.tp_bandwidth, help="per rank, e.g. 150GB")
    c.add_argument("--pp-bandwidth", type=Size(), default=Hardware.pp_bandwidth,
                   help="per rank, for the pipeline's point-to-point transfers, e.g. 25GB")
    c.add_argument("--pcie-bandwidth", type=Size(), default=Hardware.pcie_bandwidth, help="per rank")
    c.add_argument("--disk-bandwidth", type=Size(), default=Hardware.disk_bandwidth, help="per node")
    c.add_argument("--cpu-adam-rate", type=Number(float, low=0.0, low_ok=False), default=Hardware.cpu_adam_rate,
                   help="parameters per second per rank AdamW updates on the CPU")
    e = p.add_argument_group("layouts")
    e.add_argument("--tp-sizes", type=Items(Number(int, low=1)), default=None)
    e.add_argument("--cp-sizes", type=Items(Number(int, low=1)), default=None,
                   help="context-parallel sizes to try (default 1, or --context-parallel-size's)")
    e.add_argument("--pp-sizes", type=Items(Number(int, low=1)), default=None,
                   help="pipeline sizes (default: every one that divides the world over TP and the layers)")
    e.add_argument("--virtual-stages", type=Items(Number(int, low=2)), default=None,
                   help="model chunks per pipeline rank the interleaved schedule tries (default 2)")
    e.add_argument("--zero-bubble", type=Items(Choice(("no", "yes"))), default=None,
                   help="whether pipelines try ZB-H1: no, yes or no,yes (default)")
    e.add_argument("--ep-sizes", type=Items(Number(int, low=1)), default=None,
                   help="expert-parallel sizes to try with --num-experts (default: every divisor of the expert count "
                        "the grid folds)")
    e.add_argument("--moe-plan-routing", choices=("worst", "balanced"), default="worst",
                   help="the routing a mixture of experts' activations are planned at: worst, every slot of the EP "
                        "group's tokens that can reach a rank's experts does (dropless; with a capacity factor its "
                        "bound), or balanced, every expert its share (the other is printed beside)")
    e.add_argument("--zero-stages", type=Items(Number(int, low=0, high=3, high_ok=True)), default=None)
    e.add_argument("--offload-tiers", type=Items(Choice(("none", "cpu", "disk"))), default=None,
                   help="subset of none,cpu,disk")
    e.add_argument("--recompute-modes", type=Items(Choice(("none", "selective", "full"))), default=None,
                   help="subset of none,selective,full")
    e.add_argument("--micro-batch-sizes", type=Items(Number(int, low=1)), default=None)
    e.add_argument("--max-micro-batch-size", type=Number(int, low=1), default=64)
    o = p.add_argument_group("output")
    o.add_argument("--top", type=Number(int, low=1), default=10, help="layouts shown (fastest that fit first)")
    o.add_argument("--all", action="store_true", help="show every layout, also those that do not fit")
    o.add_argument("--json", action="store_true", help="one JSON object on stdout")
    return p


def dest(flag: str) -> str:
    """--flag-name or --flag-name=value -> flag_name (argparse's destination)."""
    return flag.split("=", 1)[0].lstrip("-").replace("-", "_")


def given_flags(rest: list[str]) -> set[str]:
    """The destinations of the pretrain_gpt.py flags the command line or its --config file sets."""
    present = {dest(token) for token in rest if token.startswith("--")}
    if "config" in present:
        config = rest[rest.index("--config") + 1] if "--config" in rest else next(
            t.split("=", 1)[1] for t in rest if t.startswith("--config="))
        present |= set(read_config_file(config, build_parser()))
    return present


# pretrain_gpt.py's flags that choose a layout: a given one keeps the layouts that have its value
LAYOUT_FLAGS = {"tensor_model_parallel_size": "--tensor-model-parallel-size", "zero_stage": "--zero-stage",
                "micro_batch_size": "--micro-batch-size", "offload_optimizer": "--offload-optimizer",
                "optimizer_cpu_offload": "--optimizer-cpu-offload", "offload_params": "--offload-params",
                "sequence_parallel": "--sequence-parallel", "recompute_activations": "--recompute-activations",
                "recompute_granularity": "--recompute-granularity", "zero_units": "--zero-units",
                "context_parallel_size": "--context-parallel-size",
                "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
                "num_virtual_stages_per_pipeline_rank": "--num-virtual-stages-per-pipeline-rank",
                "num_layers_per_virtual_pipeline_stage": "--num-layers-per-virtual-pipeline-stage",
                "enable_zero_bubble": "--enable-zero-bubble",
                "expert_model_parallel_size": "--expert-model-parallel-size",
                "expert_tensor_parallel_size": "--expert-tensor-parallel-size"}


def layout_restrictions(args: argparse.Namespace, present: set[str]) -> tuple[dict, str | None]:
    """({layout attribute: the value the given layout flags fix}, the note saying so, or None)."""
    fixed, said = {}, []
    for dest, attribute in (("tensor_model_parallel_size", "tp"), ("context_parallel_size", "cp"),
                            ("zero_stage", "stage"),
                            ("micro_batch_size", "micro_batch"), ("offload_params", "offload_params"),
                            ("sequence_parallel", "sequence_parallel"), ("zero_units", "units"),
                            ("expert_model_parallel_size", "ep")):
        if dest in present:
            fixed[attribute] = getattr(args, dest)
            said.append(f"{LAYOUT_FLAGS[dest]} {getattr(args, dest)}")
    if "expert_tensor_parallel_size" in present:  # the layout's None stands for TP
        etp = args.expert_tensor_parallel_size
        fixed["expert_tp"] = etp if args.tensor_model_parallel_size != etp else None
        said.append(f"--expert-tensor-parallel-size {etp}")
    if "use_distributed_optimizer" in present and "zero_stage" not in present:  # Megatron's words for ZeRO-1
        fixed["stage"] = 1
        said.append("--use-distributed-optimizer (ZeRO-1)")
    if present & {"offload_optimizer", "optimizer_cpu_offload"}:
        fixed["offload_optimizer"] = "cpu" if args.optimizer_cpu_offload else args.offload_optimizer
        said.append(f"--offload-optimizer {fixed['offload_optimizer']}")
    if "pipeline_model_parallel_size" in present:
        fixed["pp"] = args.pipeline_model_parallel_size
        said.append(f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}")
    if present & {"num_virtual_stages_per_pipeline_rank", "num_layers_per_virtual_pipeline_stage"}:
        fixed["virtual_stages"] = virtual_stages(args.pipeline_model_parallel_size, args.num_layers,
                                                 args.num_layers_per_virtual_pipeline_stage,
                                                 args.num_virtual_stages_per_pipeline_rank)
        said.append(f"virtual stages {fixed['virtual_stages']}")
    if "enable_zero_bubble" in present:
        fixed["zero_bubble"] = True
        said.append("--enable-zero-bubble")
    if present & {"recompute_activations", "recompute_granularity"}:
        fixed["recompute"] = "selective" if args.recompute_activations else (args.recompute_granularity or "none")
        said.append(f"recompute {fixed['recompute']}")
    note = f"note: layouts restricted to the layout flags given: {', '.join(said)}" if said else None
    return fixed, note


def training_argv(rest: list[str]) -> list[str]:
    """pretrain_gpt.py's flags with what a plan does not need filled in (unless the command line or --config set
    it)."""
    present = given_flags(rest)
    extra = [token for flag, value in DEFAULTS.items() if dest(flag) not in present for token in (flag, value)]
    if "data_path" not in present and "mock_data" not in present:
        extra.append("--mock-data")
        if "vocab_size" not in present:
            extra += ["--vocab-size", "50257"]
    return rest + extra


def plan(argv: list[str]) -> dict:
    opts, rest = planner_parser().parse_known_args(argv)
    args = parse_args(training_argv(rest))
    hw = Hardware(opts.device_tflops, opts.efficiency, opts.dp_bandwidth, opts.tp_bandwidth, opts.pcie_bandwidth,
                  opts.disk_bandwidth, opts.cpu_adam_rate, opts.gpus_per_node, opts.pp_bandwidth)
    reserve = opts.device_reserve if opts.device_reserve is not None else (
        DEFAULT_RESERVE["cuda"] if opts.device == "cuda" else DEFAULT_RESERVE["cpu"])
    machine = Machine(opts.world_size, opts.device_memory, opts.host_memory, opts.disk_space, reserve,
                      opts.device == "cuda", hw)
    if opts.world_size < 1:
        raise ConfigError(f"--world-size {opts.world_size} must be positive")
    planner = Planner(planner_sections(args, tokenizer_record(args)["vocab_size"]), machine, opts.moe_plan_routing)
    zero_bubble = None if opts.zero_bubble is None else tuple(choice == "yes" for choice in opts.zero_bubble)
    fixed, note = layout_restrictions(args, given_flags(rest))
    layouts = planner.layouts(opts.tp_sizes, opts.zero_stages, opts.offload_tiers, opts.recompute_modes,
                              opts.micro_batch_sizes, opts.max_micro_batch_size, pps=opts.pp_sizes,
                              virtual=opts.virtual_stages, zero_bubble=zero_bubble,
                              cps=opts.cp_sizes or (fixed.get("cp", 1),), eps=opts.ep_sizes,
                              expert_tps=None if "expert_tp" not in fixed else (fixed["expert_tp"] or 0,))
    layouts = [layout for layout in layouts if all(getattr(layout, k) == v for k, v in fixed.items())]
    if not layouts:
        raise ConfigError("no layout to evaluate: the head count, the world size, the global batch and the "
                          "restrictions given (the --*-sizes/--*-stages/--*-tiers/--*-modes flags and "
                          "pretrain_gpt.py's own layout flags) leave none")
    if note and not opts.json:
        print(note)
    plans = rank_plans([planner.evaluate(layout) for layout in layouts])
    best = plans[0] if plans[0].fits else None
    command = torchrun_command(training_argv(rest), best.layout, machine, opts.offload_path) if best else None
    result = {"plans": plans, "best": best, "command": command, "machine": machine, "planner": planner,
              "opts": opts, "rest": rest}
    if opts.json:
        print(json.dumps({"machine": {"world_size": machine.world_size, "device_memory": machine.device_memory,
                                      "host_memory": machine.host_memory, "disk_space": machine.disk_space,
                                      "device_reserve": machine.device_reserve, "cuda": machine.cuda,
                                      "ranks_per_node": machine.ranks_per_node, "hardware": vars(hw)},
                          "layouts": [p.to_json() for p in plans], "best": best.to_json() if best else None,
                          "command": command}, default=float))
    else:
        print_text(result)
    return result


def print_text(result: dict) -> None:
    plans, best, machine, planner, opts = (result[k] for k in ("plans", "best", "machine", "planner", "opts"))
    model, hw = planner.run.model, machine.hardware
    first = plans[0].states
    print(f"model: GPT {model.num_layers} layers, hidden {model.hidden_size}, {model.num_attention_heads} heads, "
          f"sequence {planner.seq}, vocabulary {model.vocab_size}; {planner.precision.dtype} "
          f"({planner.p}-byte parameters, {planner.g}-byte gradients)")
    print(f"machine: {machine.world_size} ranks ({machine.ranks_per_node} per node), {opts.device_memory / GIB:.2f} "
          f"GiB per device (reserve {machine.device_reserve / GIB:.2f}), host "
          f"{'not checked' if machine.host_memory is None else f'{machine.host_memory / GIB:.0f} GiB per node'}, "
          f"disk {'none' if machine.disk_space is None else f'{machine.disk_space / GIB:.0f} GiB per node'}; "
          f"cost model: {hw.device_tflops:g} TFLOP/s x {hw.efficiency:g}, DP {hw.dp_bandwidth / 1e9:g} GB/s, "
          f"TP {hw.tp_bandwidth / 1e9:g} GB/s, PCIe {hw.pcie_bandwidth / 1e9:g} GB/s, disk "
          f"{hw.disk_bandwidth / 1e9:g} GB/s per node, CPU AdamW {hw.cpu_adam_rate:g} params/s per rank")
    fitting = sum(p.fits for p in plans)
    reasons = {}
    for p in plans:
        for why in filter(None, p.why.split(",")):
            reasons[why] = reasons.get(why, 0) + 1
    print(f"layouts: {len(plans)} evaluated, {fitting} fit"
          + "".join(f"; {n} over the {why} budget" for why, n in sorted(reasons.items()))
          + f" (trainable parameters per TP rank at TP {plans[0].layout.tp}: {first.numel:,})")
    experts = bool(model.num_experts)
    print(header(experts) + "    (GiB per rank unless per node)")
    shown = plans if opts.all else [p for p in plans if p.fits][:opts.top]
    for i, p in enumerate(shown, start=1):
        print(row(i, p, experts))
    if best is None:
        closest = min(plans, key=lambda p: p.device_peak)
        print(f"nothing fits; the smallest device peak is {closest.device_peak / GIB:.2f} GiB: "
              f"{closest.layout.describe()}")
        return
    print(f"best: {best.layout.describe()}")
    for line in components_text(best):
        print(line)
    print("the run prints (at start; stage 3 adds its peak after the first iteration):")
    print("  " + best.states.report.line())
    print("  " + best.states.comm.line())
    print("command:")
    print("  " + result["command"])
    dry = result["command"].split(" pretrain_gpt.py ", 1)[1]
    print("confirm any rank without a GPU (tensors without data; its figures are this plan's with --device cpu):")
    print(f"  python pretrain_gpt.py --dry-run --world-size {machine.world_size} --rank 0 {dry}")


def main(argv: list[str] | None = None) -> int:
    return exit_code(lambda: plan(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
