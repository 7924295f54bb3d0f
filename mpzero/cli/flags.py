"""pretrain_gpt.py's flags, one group per config section they fill, with Megatron-LM's names: each function adds
the flags of its section, and a default is the section's own (read from its dataclass) wherever the two agree,
so one name per knob holds from the flag to the config file, the checkpoint's meta.json and TensorBoard.
`arguments.build_parser` puts the groups together and gives every value its checked type (mpzero/cli/checks.py).
These are argument tables: long by nature, one `add_argument` per knob.
"""

from __future__ import annotations

import argparse

from mpzero.cli.moe_flags import moe_flags
from mpzero.context_parallel import CP_COMM_TYPES
from mpzero.data import TOKENIZER_TYPES
from mpzero.fused import ATTENTION_BACKENDS
from mpzero.models import CUDA_GRAPH_IMPLS, NORMALIZATIONS, POSITION_EMBEDDINGS, GPTConfig
from mpzero.optim import RULES
from mpzero.tensor_parallel import FP8_FORMATS, FP8_RECIPES
from mpzero.training import DECAY_STYLES, EvalConfig, LoggingConfig, ParallelConfig, ProfileConfig, TrainingConfig
from mpzero.zero import (OFFLOAD_IO, OFFLOAD_TIERS, ZERO_UNITS, OffloadConfig, OptimizerConfig, PrecisionConfig,
                         ZeroConfig)


def gpt_flags(p: argparse.ArgumentParser) -> None:
    """GPTConfig (mpzero/models): the architecture and its kernels."""
    model = p.add_argument_group("model")
    model.add_argument("--num-layers", type=int, default=None)
    model.add_argument("--hidden-size", type=int, default=None)
    model.add_argument("--num-attention-heads", type=int, default=None)
    model.add_argument("--seq-length", type=int, default=None)
    model.add_argument("--max-position-embeddings", type=int, default=None,
                       help="default: --seq-length")
    model.add_argument("--hidden-dropout", type=float, default=GPTConfig.hidden_dropout)
    model.add_argument("--attention-dropout", type=float, default=GPTConfig.attention_dropout)
    model.add_argument("--init-method-std", type=float, default=GPTConfig.init_method_std)
    model.add_argument("--layernorm-epsilon", "--norm-epsilon", dest="layernorm_epsilon", type=float,
                       default=GPTConfig.layernorm_epsilon,
                       help="epsilon of LayerNorm or RMSNorm (--norm-epsilon is Megatron's newer name)")
    model.add_argument("--normalization", choices=NORMALIZATIONS, default=GPTConfig.normalization,
                       help="RMSNorm: LLaMA's normalization (no mean subtracted, no bias)")
    model.add_argument("--swiglu", action="store_true",
                       help="gated MLP down(silu(gate(x)) * up(x)); --ffn-hidden-size defaults to int(8h/3 / 64) * 64")
    model.add_argument("--ffn-hidden-size", type=int, default=None, help="the MLP's hidden width (default 4h)")
    model.add_argument("--position-embedding-type", choices=POSITION_EMBEDDINGS,
                       default=GPTConfig.position_embedding_type,
                       help="rope: rotary embeddings on q and k (HF's rotate-half convention) instead of learned "
                            "absolute positions")
    model.add_argument("--no-position-embedding", dest="add_position_embedding", action="store_false",
                       help="no learned absolute position embedding")
    model.add_argument("--rotary-base", type=int, default=10000, help="RoPE's theta (Llama 3: 500000)")
    model.add_argument("--rotary-percent", type=float, default=GPTConfig.rotary_percent,
                       help="the share of each head's features RoPE rotates")
    model.add_argument("--group-query-attention", action="store_true",
                       help="grouped-query attention: --num-query-groups key/value heads, each shared by "
                            "heads / groups query heads")
    model.add_argument("--num-query-groups", type=int, default=None,
                       help="key/value heads with --group-query-attention (default 1); divisible by TP")
    model.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false",
                       help="no biases in the attention and MLP linears (LLaMA)")
    model.add_argument("--kv-channels", type=int, default=None,
                       help="projection size per attention head: Q is heads x N wide, K and V groups x N, the "
                            "output projection's input heads x N (default --hidden-size / --num-attention-heads)")
    model.add_argument("--qk-layernorm", action="store_true",
                       help="--normalization over each head's queries and keys before RoPE (Qwen3, OLMo 2)")
    model.add_argument("--make-vocab-size-divisible-by", type=int, default=GPTConfig.make_vocab_size_divisible_by)
    model.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                       help="an output projection of its own instead of the input embedding's transpose")
    model.add_argument("--openai-gelu", action="store_true",
                       help="GELU's tanh approximation (OpenAI's GPT-2) instead of the exact erf form")


def kernel_flags(p: argparse.ArgumentParser) -> None:
    """How GPTConfig's model is computed, not what it is: the fused ops, attention backend, compilation, the loss."""
    kernels = p.add_argument_group("kernels and compilation (mpzero/fused; the choices are printed on the 'fused ops' "
                                 "line)")
    kernels.add_argument("--no-masked-softmax-fusion", dest="masked_softmax_fusion", action="store_false",
                       help="attention softmax by the PyTorch reference instead of the fused op")
    kernels.add_argument("--use-flash-attn", action="store_true",
                       help="Megatron's older spelling of --attention-backend flash")
    kernels.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=GPTConfig.attention_backend,
                       help="flash: torch's scaled_dot_product_attention (FlashAttention-2, cuDNN or memory-efficient "
                            "kernels on GPUs, never an [s, s] tensor); fused: the same restricted to cuDNN's fused "
                            "attention (CUDA only); local: Megatron's core attention (explicit scores, the fused "
                            "scale + mask + softmax op); unfused: the same with the PyTorch reference softmax; auto "
                            "(default): flash on GPUs, and on CPUs without attention dropout; local on CPUs with "
                            "it (the choice is printed on the 'fused ops' line)")
    kernels.add_argument("--torch-compile", action="store_true",
                       help="compile each transformer layer's forward with torch.compile (torchtitan's regional "
                            "compilation; inductor: Triton kernels on GPUs, C++ on CPUs), and the embedding, all the "
                            "layers and the final norm as one region where nothing in them runs eagerly (TP 1, no "
                            "recomputation, no activation offload, no ZeRO-3); the first iteration pays the "
                            "compilation")
    kernels.add_argument("--cuda-graph-impl", choices=CUDA_GRAPH_IMPLS, default=GPTConfig.cuda_graph_impl,
                       help="local: the trunk compiled as one region (--torch-compile at TP 1 without recomputation "
                            "or ZeRO-3) is captured into CUDA graphs by inductor's CUDA graph trees, its forward and "
                            "backward each replayed as one launch; a trunk inductor cannot capture is an error. "
                            "CUDA only: on other devices the trunk runs as without it (the 'fused ops' line says "
                            "so). Megatron's local implementation captures each layer; none (default): no CUDA graphs")
    kernels.add_argument("--cross-entropy-chunk-size", type=int, default=GPTConfig.cross_entropy_chunk_size,
                       help="tokens per chunk of the output projection fused with the vocab-parallel cross entropy: "
                            "the [b, s, V/TP] logits and their fp32 softmax are never held whole, each chunk's "
                            "logits are recomputed in backward (2hV/TP more FLOPs per token); 0: the logits path")
    kernels.add_argument("--cross-entropy-loss-fusion", action="store_true",
                       help="each chunk's loss arithmetic (max, exp-sum, the softmax gradient) through torch.compile, "
                            "reading the logits in the model's dtype, a kernel per pass, instead of the in-place "
                            "PyTorch reference on an fp32 copy (auto: fused on GPUs, the reference on CPUs); needs "
                            "--cross-entropy-chunk-size > 0")
    kernels.add_argument("--no-layernorm-fusion", dest="layernorm_fusion", action="store_false",
                       help="LayerNorm by the PyTorch reference instead of the fused op")
    kernels.add_argument("--no-adam-fusion", dest="adam_fusion", action="store_false",
                       help="AdamW by torch.optim.AdamW's single-tensor arithmetic instead of the fused op")


def fp8_flags(p: argparse.ArgumentParser) -> None:
    """GPTConfig's FP8 fields (mpzero/tensor_parallel/fp8.py): Megatron's flags, torchao's recipes."""
    fp8 = p.add_argument_group("FP8 (through torchao: pip install -e '.[fp8]'; needs --bf16)")
    fp8.add_argument("--fp8-format", choices=FP8_FORMATS, default=None,
                     help="the transformer layers' linears run their matmuls in FP8: hybrid casts the forward's "
                          "operands to e4m3 and gradients to e5m2, e4m3 everything; weights, gradients, optimizer "
                          "states and checkpoints stay those of the bf16 run; the output layer stays bf16")
    fp8.add_argument("--fp8-recipe", choices=FP8_RECIPES, default=GPTConfig.fp8_recipe,
                     help="scaling (torchao's recipes, current scaling): tensorwise (one scale per tensor, "
                          "Megatron's tensorwise), rowwise (a scale per row, e4m3), rowwise_with_gw_hp (rowwise, "
                          "the weight gradient in bf16); Megatron's Transformer Engine recipes (delayed, mxfp8, "
                          "blockwise, custom) are not torchao's. Scales of TP-split tensors are the whole tensor's")
    fp8.add_argument("--fp8-auto-filter-small-kn", action="store_true",
                     help="keep in bf16 the linears torchao's auto filter finds slower in FP8 on an H100 "
                          "(torchtitan's auto_filter_small_kn; decided on the full, unsplit weight)")
    fp8.add_argument("--first-last-layers-bf16", action="store_true",
                     help="the first --num-layers-at-start-in-bf16 and the last --num-layers-at-end-in-bf16 "
                          "layers' linears stay in bf16")
    fp8.add_argument("--num-layers-at-start-in-bf16", type=int, default=GPTConfig.num_layers_at_start_in_bf16)
    fp8.add_argument("--num-layers-at-end-in-bf16", type=int, default=GPTConfig.num_layers_at_end_in_bf16)
    fp8.add_argument("--fp8-param-gather", action="store_true",
                     help="ZeRO-3 gathers the tensorwise FP8 linears' weights in float8 (1 byte per element; "
                          "torchao's float8 all-gather for FSDP), cast with the whole weight's scale: the run is "
                          "bitwise the bf16-gathered one; needs --zero-stage 3 and --fp8-recipe tensorwise")


def activation_flags(p: argparse.ArgumentParser) -> None:
    """GPTConfig's activation-memory fields: recomputation, sequence parallelism, offloaded activations."""
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
    act.add_argument("--offload-activations", choices=("none", "cpu"), default=GPTConfig.offload_activations,
                     help="cpu: keep the checkpoints (full recomputation) or else every tensor the transformer "
                          "layers save for backward in pinned host memory (torch.autograd.graph.save_on_cpu); "
                          "meant for GPU runs (on a CPU run it is a copy within host memory)")


def parallel_flags(p: argparse.ArgumentParser) -> None:
    """ParallelConfig and ZeroConfig: the TP size, the ZeRO stage and its buckets."""
    par = p.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=int, default=ParallelConfig.tensor_model_parallel_size)
    par.add_argument("--context-parallel-size", type=int, default=ParallelConfig.context_parallel_size,
                     help="CP ranks the sequence is split over (2·CP load-balanced chunks; --seq-length divisible "
                          "by 2·CP); parameters replicated, gradients reduced over DP x CP")
    par.add_argument("--cp-comm-type", choices=CP_COMM_TYPES, default=GPTConfig.cp_comm_type,
                     help="how attention sees the other CP ranks' tokens: p2p (a ring of keys and values, the next "
                          "in flight), all_gather (all keys and values gathered), a2a (all-to-all over heads, "
                          "DeepSpeed-Ulysses: heads and query groups divisible by CP)")
    par.add_argument("--distributed-timeout-minutes", type=float,
                     default=ParallelConfig.distributed_timeout_minutes)
    par.add_argument("--pipeline-model-parallel-size", type=int, default=ParallelConfig.pipeline_model_parallel_size,
                     help="pipeline stages: the layers split over this many ranks (Megatron's order tp-cp-ep-dp-pp: "
                          "stages outermost), run by 1F1B, interleaved 1F1B or ZB-H1")
    par.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                     help="interleaved 1F1B: layers per virtual stage (model chunk); sets the virtual stages per "
                          "rank to num-layers / (pipeline size x this)")
    par.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                     help="interleaved 1F1B: model chunks per pipeline rank, placed round robin")
    par.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                     help="layers on the first pipeline stage (the others split the rest evenly)")
    par.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                     help="layers on the last pipeline stage (the others split the rest evenly)")
    par.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                     help="count the embedding as one layer of the first virtual stage when splitting evenly")
    par.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                     help="count the output layer and loss as one layer of the last virtual stage")
    par.add_argument("--enable-zero-bubble", action="store_true",
                     help="ZB-H1 (Qi et al.; the flag of sail-sg's Megatron fork): each backward split into its "
                          "input-gradient and weight-gradient parts, weight gradients held back into the pipeline's "
                          "idle slots: a third of 1F1B's bubble at its activation memory")
    par.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2, 3),
                     help="0 replicated (DDP), 1 optimizer states, 2 + gradients, 3 + parameters partitioned")
    par.add_argument("--use-distributed-optimizer", action="store_true",
                     help="Megatron's distributed optimizer: optimizer states sharded over data parallelism, i.e. "
                          "ZeRO-1 (the default stage); refused with --zero-stage 0, implied by stages 2-3")
    par.add_argument("--zero-bucket-numel", type=int, default=ZeroConfig.bucket_numel,
                     help="elements per gradient bucket (stages 0-2)")
    par.add_argument("--no-overlap-comm", dest="overlap_comm", action="store_false",
                     help="reduce gradients after backward instead of from its hooks")
    par.add_argument("--no-zero-prefetch", dest="zero_prefetch", action="store_false",
                     help="stage 3: do not gather the next unit's parameters ahead of time")
    par.add_argument("--zero-units", choices=ZERO_UNITS, default=ZeroConfig.units,
                     help="stage 3: what is gathered at once: each transformer layer, or each linear layer in it "
                     "(ZeRO-Infinity's memory-centric tiling: the working set is the largest linear, not a layer; "
                     "a layer under full recomputation is gathered a third time)")
    par.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                     action="store_false", help="apply updates with a non-finite loss or gradient norm "
                     "(by default the run stops before such an update; fp16 skips it)")


def dry_run_flags(p: argparse.ArgumentParser) -> None:
    """The dry run's switches (mpzero/cli/dry_run.py): the job it simulates."""
    dry = p.add_argument_group("dry run (mpzero/cli/dry_run.py)")
    dry.add_argument("--dry-run", action="store_true",
                     help="build the model and ZeRO optimizer of rank --rank of a --world-size job on fake tensors "
                          "and a fake process group, run one iteration, print its memory and communication lines "
                          "and the planner's: nothing is allocated, no GPU needed")
    dry.add_argument("--world-size", type=int, default=None, help="--dry-run: the job's number of ranks")
    dry.add_argument("--rank", type=int, default=None, help="--dry-run: the global rank to simulate (default 0)")


def offload_flags(p: argparse.ArgumentParser) -> None:
    """OffloadConfig (mpzero/zero/config.py): where the optimizer states and parameters live."""
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


def precision_flags(p: argparse.ArgumentParser) -> None:
    """PrecisionConfig: the dtype, gradient accumulation and loss scaling."""
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


def training_flags(p: argparse.ArgumentParser) -> None:
    """TrainingConfig, OptimizerConfig (each update rule's own flags) and the LR schedule."""
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
    train.add_argument("--seed", type=int, default=TrainingConfig.seed)
    train.add_argument("--log-interval", type=int, default=LoggingConfig.log_interval)
    train.add_argument("--lr-decay-style", choices=DECAY_STYLES, default="linear")
    train.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    train.add_argument("--lr-warmup-iters", type=int, default=0)
    train.add_argument("--lr-warmup-fraction", type=float, default=None)
    train.add_argument("--min-lr", type=float, default=0.0)
    train.add_argument("--exit-interval", type=int, default=None, help="stop after this many iterations")
    train.add_argument("--sync-every-iteration", action="store_true",
                       help="read the loss, gradient norm and SIGTERM flag to the host every iteration, before the "
                            "update (one synchronisation a step). By default a step with AdamW's fused kernels (an fp16 "
                            "one: the Triton kernel or --no-adam-fusion, its loss scaler on the device) is launched "
                            "without one and read at log lines, evaluations, checkpoints and the end: a non-finite "
                            "value skips its update on the device (bf16/fp32: and stops the run at that read), "
                            "SIGTERM acts there (up to --log-interval iterations late)")


def logging_flags(p: argparse.ArgumentParser) -> None:
    """EvalConfig, LoggingConfig and ProfileConfig: evaluation, console, TensorBoard, wandb and Megatron's
    --profile."""
    evaluation = p.add_argument_group("evaluation and logging")
    evaluation.add_argument("--eval-interval", type=int, default=EvalConfig.eval_interval)
    evaluation.add_argument("--eval-iters", type=int, default=EvalConfig.eval_iters)
    evaluation.add_argument("--tensorboard-dir", default=None)
    evaluation.add_argument("--wandb-project", default=None,
                            help="log the TensorBoard scalars and the run's flags to this Weights & Biases project "
                                 "as well (pip install -e '.[wandb]'; WANDB_MODE=offline keeps them on the machine)")
    evaluation.add_argument("--wandb-exp-name", default=None, help="the wandb run's name (default: wandb's)")
    evaluation.add_argument("--wandb-save-dir", default=None,
                            help="the folder wandb makes its wandb/ runs folder in (default: --save, else .)")
    evaluation.add_argument("--wandb-entity", default=None, help="the wandb user or team (default: your login's)")
    evaluation.add_argument("--profile", action="store_true",
                            help="trace iterations (--profile-step-start, --profile-step-end] on --profile-ranks: "
                                 "for Nsight Systems on a GPU (run under nsys profile --capture-range=cudaProfilerApi) "
                                 "or with --use-pytorch-profiler")
    evaluation.add_argument("--use-pytorch-profiler", action="store_true",
                            help="with --profile: torch.profiler's trace, one file per rank in --tensorboard-dir")
    evaluation.add_argument("--profile-step-start", type=int, default=None,
                            help=f"with --profile: iterations done before the trace starts (default "
                                 f"{ProfileConfig.step_start})")
    evaluation.add_argument("--profile-step-end", type=int, default=None,
                            help=f"with --profile: the last iteration traced (default {ProfileConfig.step_end})")
    evaluation.add_argument("--profile-ranks", type=int, nargs="+", default=None,
                            help="with --profile: the global ranks that trace (default 0)")


def checkpoint_flags(p: argparse.ArgumentParser) -> None:
    """CheckpointConfig: saving, loading, finetuning."""
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


def data_flags(p: argparse.ArgumentParser) -> None:
    """DataConfig: mock or indexed data, its split, cache and tokenizer."""
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


# In the order --help lists them.
SECTIONS = (gpt_flags, kernel_flags, fp8_flags, activation_flags, parallel_flags, moe_flags, dry_run_flags,
            offload_flags, precision_flags, training_flags, logging_flags, checkpoint_flags, data_flags)
