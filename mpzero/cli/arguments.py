"""Command-line flags with Megatron-LM's names and defaults, turned into the typed config sections
each component receives. One name per knob: the flag `--hidden-size` is `GPTConfig.hidden_size`, the key
`hidden-size` in a `--config` file, and the same name in the configuration saved with checkpoints. The flags
themselves are declared per config section in flags.py; here they get their checked types (checks.py).

A `--config FILE` (YAML or JSON, keys are flag names without the dashes' prefix) sets defaults; the
command line overrides it. `parse_args` checks the flags on their own; `run_config` resolves what depends
on the world (DP size, the default global batch) and on input files (the tokenizer's vocabulary), checks
every section, and returns the frozen `RunConfig`. The parsed namespace is never modified.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import sys

from mpzero.checkpointing import check_save_directory
from mpzero.cli.config_file import drop_overridden, read_config_file
from mpzero.data import build_tokenizer, no_tokenizer, parse_data_path, parse_split, tokenizer_identity
from mpzero.errors import ConfigError
from mpzero.files import check_output_directory
from mpzero.cli.checks import CheckError, Parser, Path, Text
from mpzero.cli.flag_ranges import check_ranges, check_rule_flags, number
from mpzero.cli.flags import SECTIONS
from mpzero.cli.megatron_flags import unknown_arguments_message
from mpzero.models import GPTConfig, config_from_args
from mpzero.moe import check_expert_grid
from mpzero.optim import RULES
from mpzero.pipeline import PipelineConfig, check_composition, virtual_stages
from mpzero.planner import RunSections
from mpzero.training import (CheckpointConfig, DataConfig, DryRunConfig, EvalConfig, LoggingConfig, LRSchedule,
                             ParallelConfig, ProfileConfig, RunConfig, TrainingConfig, num_micro_batches)
from mpzero.zero import (OffloadConfig, OptimizerConfig, PrecisionConfig, ZeroConfig, check_fp8_param_gather,
                         check_zero_units)


class _Parser(Parser):
    """The layer's parser (one-line errors, every value checked by its type) raising a ConfigError, which
    pretrain_gpt.py prints once (on rank 0) and tools/plan_memory.py through its own exit."""

    def fail(self, message: str):
        raise ConfigError(message)


# The type of every flag that takes a value and is no number (numbers: their RANGES, mpzero/cli/flag_ranges.py).
_OUTPUT_DIR = Path("dir", exists=False, writable=True)  # created at start (not by --dry-run), checked before
# The tokenizer's files are text here: the tokenizer builder checks them with the type that needs them.
PATHS = {"config": Path("file", text=True), "save": _OUTPUT_DIR, "load": Path("dir", exists=False),
         "tensorboard_dir": _OUTPUT_DIR, "data_cache_path": _OUTPUT_DIR, "wandb_save_dir": _OUTPUT_DIR,
         "offload_path": _OUTPUT_DIR, "tokenizer_model": Text(), "vocab_file": Text(), "merge_file": Text(),
         "wandb_project": Text(), "wandb_exp_name": Text(), "wandb_entity": Text(), "data_path": Text(),
         "split": Text()}


def _typed(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Each flag's checked type: a number within its range, a path or text from PATHS."""
    for action in parser._actions:
        if action.type in (int, float):
            action.type = number(action.dest, action.type)
        elif action.dest in PATHS:
            action.type = PATHS[action.dest]
    return parser


def build_parser() -> argparse.ArgumentParser:
    """Every config section's flags (mpzero/cli/flags.py) and --config, each value with its checked type."""
    p = _Parser(prog="pretrain_gpt.py", description="Pretrain a GPT with TP x ZeRO-DP.")
    p.add_argument("--config", default=None, help="YAML or JSON file of flag values; the command line wins")
    for add_flags in SECTIONS:
        add_flags(p)
    return _typed(p)


REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
            "train_iters", "lr")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags, from --config and the command line (which wins), each within its range; never modified after."""
    parser = build_parser()
    config_file = _config_file_from(argv)
    if config_file:
        parser.set_defaults(**drop_overridden(read_config_file(config_file, parser), parser, argv))
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # a Megatron-LM flag mpzero lacks gets its own line (mpzero/cli/megatron_flags.py)
        raise ConfigError(unknown_arguments_message(unknown, [o for a in parser._actions for o in a.option_strings]))
    for name in REQUIRED:
        if getattr(args, name) is None:
            raise ConfigError(f"--{name.replace('_', '-')} is required (on the command line or in --config)")
    check_ranges(args)
    check_rule_flags(args)
    if args.mock_data and args.vocab_size is None:
        raise ConfigError("--mock-data needs --vocab-size")
    if args.mock_data and args.data_path:
        raise ConfigError("--mock-data and --data-path both given: the run would train on mock data and ignore "
                          "--data-path; keep one of them")
    if not args.mock_data and not args.data_path:
        raise ConfigError("no data: pass --data-path PREFIX (from tools/preprocess_data.py) or --mock-data")
    if args.data_path and args.tokenizer_type is None:
        raise ConfigError("--data-path needs --tokenizer-type (and its --tokenizer-model or --vocab-file/--merge-file)")
    if args.max_position_embeddings is not None and args.seq_length > args.max_position_embeddings:
        raise ConfigError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                          f"{args.max_position_embeddings}")
    return args


def run_config(args: argparse.Namespace, world_size: int) -> RunConfig:
    """Every section of the run, resolved and checked; raises ConfigError for the first problem found."""
    parallel = ParallelConfig(args.tensor_model_parallel_size, args.distributed_timeout_minutes,
                              pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                              context_parallel_size=args.context_parallel_size,
                              expert_model_parallel_size=args.expert_model_parallel_size,
                              expert_tensor_parallel_size=args.expert_tensor_parallel_size)
    parallel.sizes.check(world_size)
    tp, dp = parallel.tensor_model_parallel_size, parallel.sizes.dp(world_size)
    global_batch = args.global_batch_size if args.global_batch_size is not None else args.micro_batch_size * dp
    micro_batches = num_micro_batches(global_batch, args.micro_batch_size, dp)  # validates
    pipeline = pipeline_config(args, micro_batches)
    tokenizer = tokenizer_record(args)
    vocab_size = tokenizer["vocab_size"]
    model = gpt_config(args, vocab_size)
    model.validate(tp)
    sections = (zero_config(args), optimizer_config(args), precision_config(args))
    for section in sections:
        section.validate()
    check_expert_run(model, parallel.sizes, sections[2].dtype)
    if model.fp8_format is not None and sections[2].dtype != "bf16":
        raise ConfigError(f"--fp8-format runs the matmuls in FP8 from bf16 weights and activations (torchao's float8 "
                          f"training), but the run is {sections[2].dtype}: add --bf16")
    offload = offload_config(args)
    offload.validate(args.zero_stage)
    check_fp8_param_gather(sections[0], model.fp8, offload)
    if sections[0].fp8_param_gather and model.num_experts:
        raise ConfigError("--fp8-param-gather with --num-experts: gathering float8 weights is built and tested for "
                          "dense models only (the experts' own ZeRO family is not): drop one of them")
    if args.data_path:  # the strings alone, before any file is opened
        parse_data_path(args.data_path)
        parse_split(args.split)
    if not args.dry_run:  # a dry run touches nothing on disk: its paths were checked as the flags' types
        _prepare_output_directories(args, offload)
    logging = logging_config(args)
    profile = profile_config(args, world_size)
    resolved = {"global_batch_size": global_batch, "vocab_size": vocab_size,
                "max_position_embeddings": model.max_position_embeddings}
    return RunConfig(
        model=model,
        parallel=parallel,
        training=TrainingConfig(args.micro_batch_size, global_batch, args.train_iters, args.seq_length, args.seed,
                                args.exit_interval, args.check_for_nan_in_loss_and_grad,
                                sync_every_iteration=args.sync_every_iteration),
        evaluation=EvalConfig(args.eval_interval, args.eval_iters),
        data=DataConfig(args.mock_data, tuple(args.data_path) if args.data_path else None, args.split,
                        args.data_cache_path, vocab_size, tokenizer, args.override_tokenizer_check),
        checkpoint=CheckpointConfig(args.save, args.load, args.save_interval,
                                    load_optim=not (args.finetune or args.no_load_optim),
                                    load_rng=not (args.finetune or args.no_load_rng), finetune=args.finetune,
                                    overwrite=args.overwrite_checkpoints),
        logging=logging,
        schedule=lr_schedule(args), zero=sections[0], optimizer=sections[1], precision=sections[2], offload=offload,
        pipeline=pipeline,
        profile=profile, dry_run=DryRunConfig(args.world_size or 1, args.rank or 0) if args.dry_run else None,
        flags={**vars(args), **resolved})


def _prepare_output_directories(args: argparse.Namespace, offload: OffloadConfig) -> None:
    """A real run's output directories, created and probed at start (a dry run skips this)."""
    if offload.path:
        check_offload_directory(offload)
    if args.save:
        check_save_directory(args.save, args.load, args.finetune, args.overwrite_checkpoints)
    for flag, path in (("--tensorboard-dir", args.tensorboard_dir), ("--data-cache-path", args.data_cache_path)):
        if path:
            check_output_directory(path, flag)


WANDB_FLAGS = ("wandb_exp_name", "wandb_save_dir", "wandb_entity")


def logging_config(args: argparse.Namespace) -> LoggingConfig:
    """TensorBoard and wandb; with --wandb-project the wandb package must be importable and its directory
    writable (created if missing), and the other --wandb-* flags need --wandb-project."""
    for name in ("wandb_project",) + WANDB_FLAGS:
        if getattr(args, name) is not None and not getattr(args, name).strip():
            raise ConfigError(f"--{name.replace('_', '-')} is empty: give a name or drop the flag")
    if args.wandb_project is None:
        given = [name for name in WANDB_FLAGS if getattr(args, name) is not None]
        if given:
            raise ConfigError(f"--{given[0].replace('_', '-')} needs --wandb-project (the project to log to)")
        return LoggingConfig(args.log_interval, args.tensorboard_dir)
    try:
        import wandb  # noqa: F401 - only whether it is installed
    except ImportError:
        raise ConfigError("--wandb-project needs the wandb package, which is not installed: "
                          "pip install -e '.[wandb]', or drop --wandb-project") from None
    save_dir = args.wandb_save_dir or args.save or "."  # wandb writes its runs into DIR/wandb/ (Megatron's dir=)
    if not args.dry_run:
        check_output_directory(save_dir, "--wandb-save-dir")
    return LoggingConfig(args.log_interval, args.tensorboard_dir, args.wandb_project, args.wandb_exp_name, save_dir,
                         args.wandb_entity)


PROFILE_FLAGS = ("use_pytorch_profiler", "profile_step_start", "profile_step_end", "profile_ranks")


def profile_config(args: argparse.Namespace, world_size: int) -> ProfileConfig:
    """Megatron's --profile and its window; the flags that shape it need --profile, the window lies inside the run,
    the ranks inside the world, and torch.profiler's trace needs --tensorboard-dir to go to. (Nsight Systems' mode
    needs CUDA: checked at start, where the device is known.)"""
    if not args.profile:
        given = [name for name in PROFILE_FLAGS if getattr(args, name) not in (None, False)]
        if given:
            raise ConfigError(f"--{given[0].replace('_', '-')} shapes --profile's trace, but --profile is not given: "
                              f"add --profile or drop it")
        return ProfileConfig()
    if args.dry_run:
        raise ConfigError("--profile traces iterations, and --dry-run runs none: drop one of them")
    start = args.profile_step_start if args.profile_step_start is not None else ProfileConfig.step_start
    end = args.profile_step_end if args.profile_step_end is not None else ProfileConfig.step_end
    if end <= start:
        raise ConfigError(f"--profile-step-end {end} is not after --profile-step-start {start}: the trace covers "
                          f"iterations start+1 to end")
    if end > args.train_iters:
        raise ConfigError(f"--profile-step-end {end} is past --train-iters {args.train_iters}: the trace would never "
                          f"end; lower --profile-step-start/--profile-step-end")
    ranks = tuple(args.profile_ranks) if args.profile_ranks is not None else ProfileConfig.ranks
    outside = [rank for rank in ranks if rank >= world_size]
    if outside:
        raise ConfigError(f"--profile-ranks {outside[0]} is not a rank of this {world_size}-process run "
                          f"(ranks 0-{world_size - 1})")
    if args.use_pytorch_profiler and not args.tensorboard_dir:
        raise ConfigError("--use-pytorch-profiler writes its traces into --tensorboard-dir: give one")
    return ProfileConfig(True, args.use_pytorch_profiler, start, end, tuple(sorted(set(ranks))))


def tokenizer_record(args: argparse.Namespace) -> dict:
    """The tokenizer's record: type, files' sha256, vocabulary (before padding for TP); --vocab-size for mock data."""
    if args.mock_data:
        return no_tokenizer(args.vocab_size)
    return tokenizer_identity(build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_file,
                                              args.merge_file, args.vocab_size))


def gpt_config(args: argparse.Namespace, vocab_size: int) -> GPTConfig:
    """The model's config, by its family's record (`mpzero.models.config_from_args`)."""
    return config_from_args(args, vocab_size)


def lr_schedule(args: argparse.Namespace) -> LRSchedule:
    """Megatron's defaults: decay over --train-iters unless --lr-decay-iters is given; warmup from
    --lr-warmup-iters, or --lr-warmup-fraction of the decay iterations."""
    decay_iters = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
    if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
        raise ConfigError("give either --lr-warmup-fraction or --lr-warmup-iters, not both")
    warmup = (int(args.lr_warmup_fraction * decay_iters) if args.lr_warmup_fraction is not None
              else args.lr_warmup_iters)
    return LRSchedule(max_lr=args.lr, min_lr=args.min_lr, warmup_iters=warmup, decay_iters=decay_iters,
                      decay_style=args.lr_decay_style)


def zero_config(args: argparse.Namespace) -> ZeroConfig:
    if args.use_distributed_optimizer and args.zero_stage == 0:
        raise ConfigError("--use-distributed-optimizer shards the optimizer states over data parallelism (ZeRO-1), "
                          "but --zero-stage 0 replicates them: drop one of them")
    zero = ZeroConfig(stage=args.zero_stage, bucket_numel=args.zero_bucket_numel, overlap_comm=args.overlap_comm,
                      prefetch=args.zero_prefetch, units=args.zero_units, fp8_param_gather=args.fp8_param_gather,
                      check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad)
    check_zero_units(zero, args.torch_compile, args.cuda_graph_impl)
    return zero


def pipeline_config(args: argparse.Namespace, micro_batches: int) -> PipelineConfig:
    """Megatron's pipeline flags (and the zero-bubble fork's), checked against the layers, the micro-batches per
    iteration, the ZeRO stage and the CUDA graphs."""
    config = pipeline_section(args)
    check_composition(config, args.zero_stage, args.cuda_graph_impl)
    if config.zero_bubble and args.fp8_format:
        raise ConfigError("--fp8-format with --enable-zero-bubble: the FP8 linears compute their weight gradients in "
                          "the backward pass and cannot defer them to zero bubble's W pass: drop one of them")
    if config != PipelineConfig():
        config.validate(args.num_layers, micro_batches)
    return config


def pipeline_section(args: argparse.Namespace) -> PipelineConfig:
    """The pipeline flags as a section, before the checks against the run (`pipeline_config` makes them)."""
    size = args.pipeline_model_parallel_size
    return PipelineConfig(size, virtual_stages(size, args.num_layers, args.num_layers_per_virtual_pipeline_stage,
                                               args.num_virtual_stages_per_pipeline_rank),
                          args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers,
                          args.account_for_embedding_in_pipeline_split, args.account_for_loss_in_pipeline_split,
                          args.enable_zero_bubble)


def planner_sections(args: argparse.Namespace, vocab_size: int) -> RunSections:
    """The run the flags describe, as the planner takes it (`mpzero.planner.Planner`): its sections resolved by the
    flags' own functions, the layout flags at their given values (a layout replaces them; the pipeline's split
    flags stay and are checked against each layout's pipeline)."""
    return RunSections(gpt_config(args, vocab_size), zero_config(args), offload_config(args), optimizer_config(args),
                       precision_config(args), args.seq_length, args.global_batch_size, pipeline_section(args))


def offload_config(args: argparse.Namespace) -> OffloadConfig:
    optimizer = args.offload_optimizer or ("cpu" if args.optimizer_cpu_offload else "none")
    if args.optimizer_cpu_offload and optimizer != "cpu":
        raise ConfigError(f"--optimizer-cpu-offload means --offload-optimizer cpu, but --offload-optimizer "
                          f"{optimizer} was given too: keep one of them")
    return OffloadConfig(optimizer=optimizer, params=args.offload_params, path=args.offload_path,
                         sub_group_numel=args.offload_sub_group_numel, buffer_count=args.offload_buffer_count,
                         io=args.offload_io, pin_memory=args.offload_pin_memory,
                         delayed_update_after=args.offload_delayed_update_after)


def check_offload_directory(offload: OffloadConfig) -> None:
    """At start: --offload-path is a writable directory, and supports O_DIRECT when --offload-io direct."""
    check_output_directory(offload.path, "--offload-path")
    if offload.io != "direct":
        return
    probe = os.path.join(offload.path, f".direct-io-test-{os.getpid()}")
    try:  # created here or refused (never an existing file, never through a symlink), so removing it is safe
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as error:
        raise ConfigError(f"--offload-path {offload.path}: cannot create {probe} ({error.strerror or error}): "
                          f"choose a writable directory") from None
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | getattr(os, "O_DIRECT", 0))
    except OSError as error:
        raise ConfigError(f"--offload-io direct: the file system of --offload-path {offload.path} refuses O_DIRECT "
                          f"({error.strerror or error}; tmpfs does): use --offload-io buffered or auto, or "
                          f"another --offload-path") from None
    finally:
        os.close(fd)
        os.remove(probe)


def optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(lr=args.lr, weight_decay=args.weight_decay, clip_grad=args.clip_grad,
                           impl="auto" if args.adam_fusion else "torch",
                           rule=RULES[args.optimizer].from_args(args))


def precision_config(args: argparse.Namespace) -> PrecisionConfig:
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    if args.grad_reduce_in_bf16 and dtype != "bf16":
        raise ConfigError(f"--grad-reduce-in-bf16 needs --bf16 (the run is {dtype}): drop it")
    in_fp32 = False if args.grad_reduce_in_bf16 else True if args.accumulate_allreduce_grads_in_fp32 else None
    return PrecisionConfig(dtype=dtype, initial_loss_scale=args.initial_loss_scale,
                           min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window,
                           hysteresis=args.hysteresis, loss_scale=args.loss_scale,
                           accumulate_allreduce_grads_in_fp32=in_fp32)


def _config_file_from(argv: list[str] | None) -> str | None:
    """--config's value, read first (the file sets the defaults the command line overrides); checked as its
    flag's type."""
    argv = sys.argv[1:] if argv is None else list(argv)
    for index, token in enumerate(argv):
        if token.startswith("--config="):
            return _config_path(token.split("=", 1)[1])
        if token == "--config":
            if index + 1 == len(argv):
                raise ConfigError("argument --config: expected one argument (see --help)")
            return _config_path(argv[index + 1])
    return None


def _config_path(value: str) -> str:
    try:
        return PATHS["config"](value)
    except CheckError as error:
        raise ConfigError(f"--config {error}") from None


def check_expert_run(model: GPTConfig, sizes, dtype: str) -> None:
    """The expert grid's flags against the model (mpzero.moe.check_expert_grid) and Megatron's run-level rules."""
    # a training run's rule (Megatron's); inference (tools/generate.py) runs MoE at TP > 1 on whole sequences
    if model.num_experts and sizes.tp > 1 and not model.sequence_parallel:
        raise ConfigError("When using MoE and tensor parallelism, sequence parallelism must be used (Megatron's "
                          "rule): add --sequence-parallel")
    check_expert_grid(model, sizes.ep, sizes.expert_tp)
    if sizes.ep > 1 and dtype == "fp16":
        raise ConfigError("Expert parallelism is not supported with fp16 training (Megatron's rule): use --bf16")
    if model.num_experts and sizes.expert_tp not in (1, sizes.tp):
        raise ConfigError(f"--expert-tensor-parallel-size {sizes.expert_tp} must be 1 or the TP size {sizes.tp}: "
                          f"the experts are split over the TP group itself or not at all")
