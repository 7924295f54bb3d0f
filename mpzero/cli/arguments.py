"""Command-line flags with Megatron-LM's names and defaults, turned into the typed config sections
each component receives. One name per knob: the flag `--hidden-size` is `GPTConfig.hidden_size`, the key
`hidden-size` in a `--config` file, and the same name in the configuration saved with checkpoints.

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
from mpzero.data import build_tokenizer, no_tokenizer, tokenizer_identity
from mpzero.data.tokenizer import TOKENIZER_TYPES
from mpzero.data.splits import parse_data_path, parse_split
from mpzero.errors import ConfigError
from mpzero.files import check_output_directory
from mpzero.cli.checks import CheckError, Parser, Path, Text
from mpzero.cli.flag_ranges import check_ranges, number
from mpzero.fused.impl import ATTENTION_BACKENDS
from mpzero.models import GPTConfig
from mpzero.models.gpt import NORMALIZATIONS, POSITION_EMBEDDINGS
from mpzero.training.batches import num_micro_batches
from mpzero.training.config import (CheckpointConfig, DataConfig, EvalConfig, LoggingConfig, ParallelConfig,
                                    RunConfig, TrainingConfig)
from mpzero.training.lr_schedule import DECAY_STYLES, LRSchedule
from mpzero.optim import RULES
from mpzero.zero import OptimizerConfig, PrecisionConfig, ZeroConfig
from mpzero.zero.config import OFFLOAD_IO, OFFLOAD_TIERS, OffloadConfig


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
    p = _Parser(prog="pretrain_gpt.py", description="Pretrain a GPT with TP x ZeRO-DP.")
    p.add_argument("--config", default=None, help="YAML or JSON file of flag values; the command line wins")
    model = p.add_argument_group("model")
    model.add_argument("--num-layers", type=int, default=None)
    model.add_argument("--hidden-size", type=int, default=None)
    model.add_argument("--num-attention-heads", type=int, default=None)
    model.add_argument("--seq-length", type=int, default=None)
    model.add_argument("--max-position-embeddings", type=int, default=None,
                       help="default: --seq-length")
    model.add_argument("--hidden-dropout", type=float, default=0.1)
    model.add_argument("--attention-dropout", type=float, default=0.1)
    model.add_argument("--init-method-std", type=float, default=0.02)
    model.add_argument("--layernorm-epsilon", "--norm-epsilon", dest="layernorm_epsilon", type=float, default=1e-5,
                       help="epsilon of LayerNorm or RMSNorm (--norm-epsilon is Megatron's newer name)")
    model.add_argument("--normalization", choices=NORMALIZATIONS, default="LayerNorm",
                       help="RMSNorm: LLaMA's normalization (no mean subtracted, no bias)")
    model.add_argument("--swiglu", action="store_true",
                       help="gated MLP down(silu(gate(x)) * up(x)); --ffn-hidden-size defaults to int(8h/3 / 64) * 64")
    model.add_argument("--ffn-hidden-size", type=int, default=None, help="the MLP's hidden width (default 4h)")
    model.add_argument("--position-embedding-type", choices=POSITION_EMBEDDINGS, default="learned_absolute",
                       help="rope: rotary embeddings on q and k (HF's rotate-half convention) instead of learned "
                            "absolute positions")
    model.add_argument("--no-position-embedding", dest="add_position_embedding", action="store_false",
                       help="no learned absolute position embedding")
    model.add_argument("--rotary-base", type=int, default=10000, help="RoPE's theta (Llama 3: 500000)")
    model.add_argument("--rotary-percent", type=float, default=1.0,
                       help="the share of each head's features RoPE rotates")
    model.add_argument("--group-query-attention", action="store_true",
                       help="grouped-query attention: --num-query-groups key/value heads, each shared by "
                            "heads / groups query heads")
    model.add_argument("--num-query-groups", type=int, default=None,
                       help="key/value heads with --group-query-attention (default 1); divisible by TP")
    model.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false",
                       help="no biases in the attention and MLP linears (LLaMA)")
    model.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    model.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                       help="an output projection of its own instead of the input embedding's transpose")
    model.add_argument("--openai-gelu", action="store_true",
                       help="GELU's tanh approximation (OpenAI's GPT-2) instead of the exact erf form")
    model.add_argument("--no-masked-softmax-fusion", dest="masked_softmax_fusion", action="store_false",
                       help="attention softmax by the PyTorch reference instead of the fused op")
    model.add_argument("--use-flash-attn", action="store_true",
                       help="Megatron's older spelling of --attention-backend flash")
    model.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                       help="flash: torch's scaled_dot_product_attention (FlashAttention-2, cuDNN or memory-efficient "
                            "kernels on GPUs, never an [s, s] tensor); fused: the same restricted to cuDNN's fused "
                            "attention (CUDA only); local: Megatron's core attention (explicit scores, the fused "
                            "scale + mask + softmax op); unfused: the same with the PyTorch reference softmax; auto "
                            "(default): flash on GPUs, local on CPUs (the choice is printed on the 'fused ops' line)")
    model.add_argument("--torch-compile", action="store_true",
                       help="compile each transformer layer's forward with torch.compile (torchtitan's regional "
                            "compilation; inductor: Triton kernels on GPUs, C++ on CPUs); the first iteration "
                            "pays the compilation")
    model.add_argument("--cross-entropy-chunk-size", type=int, default=GPTConfig.cross_entropy_chunk_size,
                       help="tokens per chunk of the output projection fused with the vocab-parallel cross entropy: "
                            "the [b, s, V/TP] logits and their fp32 softmax are never held whole, each chunk's "
                            "logits are recomputed in backward (2hV/TP more FLOPs per token); 0: the logits path")
    model.add_argument("--no-layernorm-fusion", dest="layernorm_fusion", action="store_false",
                       help="LayerNorm by the PyTorch reference instead of the fused op")
    model.add_argument("--no-adam-fusion", dest="adam_fusion", action="store_false",
                       help="AdamW by torch.optim.AdamW's single-tensor arithmetic instead of the fused op")

    act = p.add_argument_group("activation memory (Megatron's recomputation and sequence-parallel flags)")
    act.add_argument("--recompute-activations", action="store_true",
                     help="selective recomputation, the same as --recompute-granularity selective: the core "
                          "attention (scores, softmax, dropout, attention over values) is recomputed in backward, "
                          "everything else stored. Whole-layer recomputation is --recompute-granularity full")
    act.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                     help="full: whole layers recomputed (--recompute-method, --recompute-num-layers); selective: "
                          "the core attention only")
    act.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                     help="with --recompute-granularity full: uniform cuts the layers into chunks of "
                          "--recompute-num-layers and keeps only each chunk's input; block recomputes the first "
                          "--recompute-num-layers layers one by one and stores the rest (default uniform)")
    act.add_argument("--recompute-num-layers", type=int, default=None,
                     help="layers per chunk (uniform) or layers recomputed (block); default 1")
    act.add_argument("--distribute-saved-activations", action="store_true",
                     help="with full recomputation and TP > 1: keep each checkpoint as a 1/TP slice per rank, "
                          "all-gathered when the layer is recomputed (ZeRO-R's partitioned activations)")
    act.add_argument("--sequence-parallel", action="store_true",
                     help="TP > 1: LayerNorms, dropouts and residual adds on a 1/TP slice of the sequence; the "
                          "column-parallel input all-gathered and the row-parallel output reduce-scattered")
    act.add_argument("--offload-activations", choices=("none", "cpu"), default="none",
                     help="cpu: keep the checkpoints (full recomputation) or else every tensor the transformer "
                          "layers save for backward in pinned host memory (torch.autograd.graph.save_on_cpu); "
                          "meant for GPU runs (on a CPU run it is a copy within host memory)")

    par = p.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1)
    par.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    par.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2, 3),
                     help="0 replicated (DDP), 1 optimizer states, 2 + gradients, 3 + parameters partitioned")
    par.add_argument("--zero-bucket-numel", type=int, default=ZeroConfig.bucket_numel,
                     help="elements per gradient bucket (stages 0-2)")
    par.add_argument("--no-overlap-comm", dest="overlap_comm", action="store_false",
                     help="reduce gradients after backward instead of from its hooks")
    par.add_argument("--no-zero-prefetch", dest="zero_prefetch", action="store_false",
                     help="stage 3: do not gather the next layer's parameters ahead of time")
    par.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                     action="store_false", help="apply updates with a non-finite loss or gradient norm "
                     "(by default the run stops before such an update; fp16 skips it)")

    dry = p.add_argument_group("dry run (mpzero/cli/dry_run.py)")
    dry.add_argument("--dry-run", action="store_true",
                     help="build the model and ZeRO optimizer of rank --rank of a --world-size job on fake tensors "
                          "and a fake process group, run one iteration, print its memory and communication lines "
                          "and the planner's: nothing is allocated, no GPU needed")
    dry.add_argument("--world-size", type=int, default=None, help="--dry-run: the job's number of ranks")
    dry.add_argument("--rank", type=int, default=None, help="--dry-run: the global rank to simulate (default 0)")

    off = p.add_argument_group("offload (ZeRO-Offload, ZeRO-Infinity)")
    off.add_argument("--offload-optimizer", choices=OFFLOAD_TIERS, default=None,
                     help="where this rank's fp32 masters and Adam moments live (stages 1-3): device memory "
                          "(none, the default), host memory (cpu) or files under --offload-path (disk); "
                          "AdamW then runs on the CPU. The result is the same bit for bit")
    off.add_argument("--optimizer-cpu-offload", action="store_true",
                     help="Megatron's flag: the same as --offload-optimizer cpu")
    off.add_argument("--offload-params", choices=OFFLOAD_TIERS, default="none",
                     help="stage 3: where this rank's parameter shards live between uses (with the optimizer "
                          "offloaded too); fetched ahead of each layer's gather")
    off.add_argument("--offload-path", default=None,
                     help="directory for the disk tier; each rank locks PATH/rankNNNNN.lock and writes under "
                          "PATH/rankNNNNN (one run per path at a time)")
    off.add_argument("--offload-sub-group-numel", type=int, default=OffloadConfig.sub_group_numel,
                     help="partition elements the disk tier updates per swap (host buffers: "
                          "buffer count x this x 12 bytes)")
    off.add_argument("--offload-buffer-count", type=int, default=OffloadConfig.buffer_count,
                     help="sub-group buffers of the disk tier (3: read the next, update one, write the previous)")
    off.add_argument("--offload-io", choices=OFFLOAD_IO, default=OffloadConfig.io,
                     help="disk tier I/O: direct (O_DIRECT: page cache bypassed; an error where the file system "
                          "refuses it), buffered, or auto (direct where possible)")
    off.add_argument("--no-offload-pin-memory", dest="offload_pin_memory", action="store_false",
                     help="GPU runs: pageable instead of page-locked host buffers (slower copies, less locked RAM)")
    off.add_argument("--offload-delayed-update-after", type=int, default=None, metavar="N",
                     help="ZeRO-Offload's one-step delayed parameter update after N ordinary steps: the CPU step "
                          "of iteration i overlaps the forward/backward of i+1, which then sees the parameters "
                          "one update late (changes the numerics; needs --offload-optimizer cpu or disk)")

    precision = p.add_argument_group("mixed precision")
    dtype = precision.add_mutually_exclusive_group()
    dtype.add_argument("--bf16", action="store_true", help="bf16 parameters, fp32 master and gradients "
                       "(bf16 gradients with --grad-reduce-in-bf16)")
    dtype.add_argument("--fp16", action="store_true", help="fp16 parameters and gradients, dynamic loss scaling")
    grads = precision.add_mutually_exclusive_group()
    grads.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                       help="gradient buffers, their accumulation over micro-batches and their reduction over DP "
                            "in fp32 (4 bytes per element); the default with --bf16, as in Megatron (with --fp16 "
                            "the gradients are fp16 unless this is given)")
    grads.add_argument("--grad-reduce-in-bf16", action="store_true",
                       help="--bf16: gradients accumulated and reduced in bf16 (2 bytes per element: half the "
                            "gradient memory and traffic, at bf16's rounding), cast to fp32 bucket by bucket for "
                            "the optimizer step; Megatron's negation of --accumulate-allreduce-grads-in-fp32")
    precision.add_argument("--loss-scale", type=float, default=None, help="static fp16 loss scale")
    precision.add_argument("--initial-loss-scale", type=float, default=PrecisionConfig.initial_loss_scale)
    precision.add_argument("--min-loss-scale", type=float, default=PrecisionConfig.min_loss_scale)
    precision.add_argument("--loss-scale-window", type=int, default=PrecisionConfig.loss_scale_window)
    precision.add_argument("--hysteresis", type=int, default=PrecisionConfig.hysteresis)

    train = p.add_argument_group("training")
    train.add_argument("--micro-batch-size", type=int, default=None)
    train.add_argument("--global-batch-size", type=int, default=None,
                       help="default: micro batch size x data-parallel size")
    train.add_argument("--train-iters", type=int, default=None)
    train.add_argument("--lr", type=float, default=None)
    train.add_argument("--optimizer", choices=tuple(RULES), default="adam",
                       help="the update rule: adam (AdamW, decoupled weight decay) or sgd (with momentum, weight "
                            "decay added to the gradient), as Megatron's")
    train.add_argument("--weight-decay", type=float, default=OptimizerConfig.weight_decay)
    for rule in RULES.values():  # each rule's own hyperparameters (--adam-beta1, --sgd-momentum, ...)
        rule.add_flags(train)
    train.add_argument("--clip-grad", type=float, default=OptimizerConfig.clip_grad)
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument("--log-interval", type=int, default=100)
    train.add_argument("--lr-decay-style", choices=DECAY_STYLES, default="linear")
    train.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    train.add_argument("--lr-warmup-iters", type=int, default=0)
    train.add_argument("--lr-warmup-fraction", type=float, default=None)
    train.add_argument("--min-lr", type=float, default=0.0)
    train.add_argument("--exit-interval", type=int, default=None, help="stop after this many iterations")

    evaluation = p.add_argument_group("evaluation and logging")
    evaluation.add_argument("--eval-interval", type=int, default=1000)
    evaluation.add_argument("--eval-iters", type=int, default=100)
    evaluation.add_argument("--tensorboard-dir", default=None)
    evaluation.add_argument("--wandb-project", default=None,
                            help="log the TensorBoard scalars and the run's flags to this Weights & Biases project "
                                 "as well (pip install -e '.[wandb]'; WANDB_MODE=offline keeps them on the machine)")
    evaluation.add_argument("--wandb-exp-name", default=None, help="the wandb run's name (default: wandb's)")
    evaluation.add_argument("--wandb-save-dir", default=None,
                            help="where wandb keeps its files (default: --save/wandb, else ./wandb)")
    evaluation.add_argument("--wandb-entity", default=None, help="the wandb user or team (default: your login's)")

    ckpt = p.add_argument_group("checkpointing")
    ckpt.add_argument("--save", default=None, help="directory to save checkpoints in")
    ckpt.add_argument("--load", default=None, help="directory to load the latest checkpoint from")
    ckpt.add_argument("--save-interval", type=int, default=None)
    ckpt.add_argument("--no-load-optim", action="store_true")
    ckpt.add_argument("--no-load-rng", action="store_true")
    ckpt.add_argument("--finetune", action="store_true",
                      help="load model weights only and start from iteration 0")
    ckpt.add_argument("--overwrite-checkpoints", action="store_true",
                      help="let a run that does not continue from --save's latest checkpoint save over it")

    data = p.add_argument_group("data")
    data.add_argument("--mock-data", action="store_true", help="train on deterministic synthetic tokens")
    data.add_argument("--vocab-size", type=int, default=None, help="vocabulary size for --mock-data / NullTokenizer")
    data.add_argument("--data-path", nargs="+", default=None,
                      help="a .bin/.idx prefix, or weights and prefixes to blend: 0.3 A 0.7 B")
    data.add_argument("--split", default="969, 30, 1", help="train, validation, test proportions")
    data.add_argument("--data-cache-path", default=None, help="where index caches go (default: beside the data)")
    data.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None)
    data.add_argument("--tokenizer-model", default=None,
                      help="SentencePiece model file, or a Hugging Face tokenizer.json or its directory")
    data.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json")
    data.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt")
    data.add_argument("--override-tokenizer-check", action="store_true",
                      help="train on although --load or --data-path was made with another tokenizer (said in a note)")
    return _typed(p)


REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
            "train_iters", "lr")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags, from --config and the command line (which wins), each within its range; never modified after."""
    parser = build_parser()
    config_file = _config_file_from(argv)
    if config_file:
        parser.set_defaults(**drop_overridden(read_config_file(config_file, parser), parser, argv))
    args = parser.parse_args(argv)
    for name in REQUIRED:
        if getattr(args, name) is None:
            raise ConfigError(f"--{name.replace('_', '-')} is required (on the command line or in --config)")
    check_ranges(args)
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
    tp = args.tensor_model_parallel_size
    if world_size % tp != 0:
        raise ConfigError(f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp}")
    dp = world_size // tp
    global_batch = args.global_batch_size if args.global_batch_size is not None else args.micro_batch_size * dp
    num_micro_batches(global_batch, args.micro_batch_size, dp)  # validates
    tokenizer = tokenizer_record(args)
    vocab_size = tokenizer["vocab_size"]
    model = gpt_config(args, vocab_size)
    model.validate(tp)
    sections = (zero_config(args), optimizer_config(args), precision_config(args))
    for section in sections:
        section.validate()
    offload = offload_config(args)
    offload.validate(args.zero_stage)
    if args.data_path:  # the strings alone, before any file is opened
        parse_data_path(args.data_path)
        parse_split(args.split)
    if not args.dry_run:  # a dry run touches nothing on disk: its paths were checked as the flags' types
        _prepare_output_directories(args, offload)
    logging = logging_config(args)
    resolved = {"global_batch_size": global_batch, "vocab_size": vocab_size,
                "max_position_embeddings": model.max_position_embeddings}
    return RunConfig(
        model=model,
        parallel=ParallelConfig(tp, args.distributed_timeout_minutes),
        training=TrainingConfig(args.micro_batch_size, global_batch, args.train_iters, args.seq_length, args.seed,
                                args.exit_interval, args.check_for_nan_in_loss_and_grad),
        evaluation=EvalConfig(args.eval_interval, args.eval_iters),
        data=DataConfig(args.mock_data, tuple(args.data_path) if args.data_path else None, args.split,
                        args.data_cache_path, vocab_size, tokenizer, args.override_tokenizer_check),
        checkpoint=CheckpointConfig(args.save, args.load, args.save_interval,
                                    load_optim=not (args.finetune or args.no_load_optim),
                                    load_rng=not (args.finetune or args.no_load_rng), finetune=args.finetune,
                                    overwrite=args.overwrite_checkpoints),
        logging=logging,
        schedule=lr_schedule(args), zero=sections[0], optimizer=sections[1], precision=sections[2], offload=offload,
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
    save_dir = args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save else "wandb")
    if not args.dry_run:
        check_output_directory(save_dir, "--wandb-save-dir")
    return LoggingConfig(args.log_interval, args.tensorboard_dir, args.wandb_project, args.wandb_exp_name, save_dir,
                         args.wandb_entity)


def tokenizer_record(args: argparse.Namespace) -> dict:
    """The tokenizer's record: type, files' sha256, vocabulary (before padding for TP); --vocab-size for mock data."""
    if args.mock_data:
        return no_tokenizer(args.vocab_size)
    return tokenizer_identity(build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_file,
                                              args.merge_file, args.vocab_size))


def gpt_config(args: argparse.Namespace, vocab_size: int) -> GPTConfig:
    return GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads, vocab_size=vocab_size,
                     max_position_embeddings=args.max_position_embeddings or args.seq_length,
                     hidden_dropout=args.hidden_dropout,
                     attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
                     layernorm_epsilon=args.layernorm_epsilon,
                     make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                     recompute_activations=args.recompute_activations,
                     recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
                     recompute_num_layers=args.recompute_num_layers,
                     distribute_saved_activations=args.distribute_saved_activations,
                     sequence_parallel=args.sequence_parallel, offload_activations=args.offload_activations,
                     layernorm_impl="auto" if args.layernorm_fusion else "torch",
                     softmax_impl="auto" if args.masked_softmax_fusion else "torch",
                     use_flash_attn=args.use_flash_attn, attention_backend=args.attention_backend,
                     torch_compile=args.torch_compile,
                     seq_length=args.seq_length,
                     untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
                     openai_gelu=args.openai_gelu, init_seed=args.seed,
                     cross_entropy_chunk_size=args.cross_entropy_chunk_size,
                     normalization=args.normalization, swiglu=args.swiglu, ffn_hidden_size=args.ffn_hidden_size,
                     position_embedding_type=args.position_embedding_type,
                     add_position_embedding=args.add_position_embedding, rotary_base=args.rotary_base,
                     rotary_percent=args.rotary_percent, group_query_attention=args.group_query_attention,
                     num_query_groups=args.num_query_groups, add_bias_linear=args.add_bias_linear)


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
    return ZeroConfig(stage=args.zero_stage, bucket_numel=args.zero_bucket_numel, overlap_comm=args.overlap_comm,
                      prefetch=args.zero_prefetch, check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad)


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
