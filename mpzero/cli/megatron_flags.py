"""Megatron-LM's flags that mpzero does not have, each with the one line a Megatron user needs instead of argparse's
"unrecognized arguments": what to use in mpzero, or that it is not supported (yet). Only flags argparse does not
know reach this table, so a flag that becomes real (in mpzero/cli/flags.py) takes precedence by itself; then its
entry here goes (tests/test_megatron_flags.py holds the two apart). The names are Megatron-LM's own, checked
against megatron/training/arguments.py's parser at commit d98e8a6 (2026-08); a Megatron flag missing here gets
argparse's answer with the nearest mpzero flag.
"""

from __future__ import annotations

import difflib

_LAYOUT = ("an explicit stage layout string is not supported: mpzero splits the layers evenly, with "
           "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers, or with "
           "--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split")
_EXPERTS_PADDED = ("padding each expert's tokens to its capacity (static shapes) is not in mpzero: the capacity "
                   "drop keeps only the tokens routed (--moe-expert-capacity-factor)")
_EXPERTS_OVERLAP = "mpzero does not overlap the MoE layer's communication with computation yet: drop the flag"
_FUSION = "mpzero has no such fused kernel to turn off (its fused ops are listed on the run's 'fused ops' line)"
_FSDP = ("mpzero's ZeRO is its data parallelism: --zero-stage 3 shards parameters, gradients and optimizer states "
         "over data-parallel ranks, as FSDP does")
_TE = "mpzero has its own layers, not Transformer Engine's: drop it"
_SAMPLES = "mpzero counts in iterations: give --train-iters, --lr-decay-iters and --lr-warmup-iters"
_LOGGED = "always logged: every log line and TensorBoard get it"
_DATA_SPLIT = "mpzero reads one --data-path (weights and prefixes) cut by --split into train, validation and test"
_MASTER_DTYPES = ("mpzero keeps fp32 master weights and Adam moments (12 bytes per parameter): move them off the "
                  "device with --offload-optimizer cpu")
_CKPT_FORMAT = ("mpzero writes one format, sharded torch.distributed.checkpoint files that load at any layout "
                "(tools/checkpoint_util.py converts them to and from one file): drop it")
_NOT_YET = "not supported by mpzero yet"

NOT_IN_MPZERO: dict[str, str] = {
    # parallelism
    "--pipeline-model-parallel-layout": _LAYOUT,
    "--hierarchical-context-parallel-sizes": ("hierarchical context parallelism (a2a+p2p) is not in mpzero: "
                                              "use --cp-comm-type p2p, all_gather or a2a"),
    "--moe-pad-expert-input-to-capacity": _EXPERTS_PADDED,
    "--moe-shared-expert-overlap": _EXPERTS_OVERLAP,
    "--overlap-moe-expert-parallel-comm": _EXPERTS_OVERLAP,
    "--moe-use-upcycling": "upcycling a dense checkpoint into experts is not in mpzero: train the MoE from scratch",
    "--moe-permute-fusion": _FUSION,
    "--moe-enable-deepep": "the flex dispatcher (DeepEP) is not in mpzero: use --moe-token-dispatcher-type alltoall",
    "--model-parallel-size": "Megatron's old name: use --tensor-model-parallel-size",
    "--use-torch-fsdp2": _FSDP,
    "--use-megatron-fsdp": _FSDP,
    "--data-parallel-sharding-strategy": _FSDP,
    "--overlap-grad-reduce": ("on by default: gradients are reduced from backward's hooks, bucket by bucket "
                              "(--no-overlap-comm turns it off)"),
    "--overlap-param-gather": ("no counterpart: the step all-gathers the updated parameters; at stage 3 each unit is "
                               "gathered ahead of its use (on by default, --no-zero-prefetch turns it off)"),
    "--ddp-bucket-size": "use --zero-bucket-numel (elements per gradient bucket)",
    "--tp-comm-overlap": "overlapping TP communication with GEMMs (Transformer Engine's userbuffers) is " + _NOT_YET,
    "--distributed-backend": "mpzero picks it: NCCL on CUDA, gloo on CPU; drop it",
    "--local-rank": "torchrun gives each process its LOCAL_RANK: drop it",
    "--use-cpu-initialization": ("not needed: every parameter is drawn on the CPU from its own generator, the same "
                                 "weights at any layout, and built one bucket at a time"),
    # precision
    "--fp16-lm-cross-entropy": "the loss is computed in fp32 (in chunks: --cross-entropy-chunk-size); drop it",
    "--use-precision-aware-optimizer": _MASTER_DTYPES,
    "--main-grads-dtype": "gradients are reduced in fp32, or in bf16 with --grad-reduce-in-bf16",
    "--main-params-dtype": _MASTER_DTYPES,
    "--exp-avg-dtype": _MASTER_DTYPES,
    "--exp-avg-sq-dtype": _MASTER_DTYPES,
    "--optimizer-offload-fraction": "offload moves all of a rank's optimizer states: --offload-optimizer cpu or disk",
    # kernels and layers
    "--transformer-impl": _TE,
    "--use-mcore-models": "mpzero has one GPT implementation: drop it",
    "--spec": "the model family comes from flags (LLaMA: --normalization RMSNorm --swiglu ...): drop it",
    "--no-gradient-accumulation-fusion": _FUSION,
    "--no-bias-gelu-fusion": _FUSION,
    "--no-bias-swiglu-fusion": _FUSION,
    "--no-bias-dropout-fusion": _FUSION,
    "--no-rope-fusion": _FUSION,
    "--no-persist-layer-norm": _FUSION,
    "--cross-entropy-fusion-impl": "use --cross-entropy-loss-fusion (torch.compile's fused loss)",
    "--recompute-modules": ("use --recompute-activations (the core attention) or --recompute-granularity full "
                            "(whole layers)"),
    "--checkpoint-activations": "Megatron's old name: use --recompute-granularity full (or --recompute-activations)",
    "--use-rotary-position-embeddings": "use --position-embedding-type rope",
    "--rotary-interleaved": "RoPE rotates halves (Hugging Face's convention); the interleaved form is " + _NOT_YET,
    "--use-rope-scaling": "RoPE scaling (Llama 3.1) is " + _NOT_YET,
    "--rope-scaling-factor": "RoPE scaling (Llama 3.1) is " + _NOT_YET,
    "--add-qkv-bias": "a bias on QKV alone (Qwen2) is " + _NOT_YET + ": biases are all on or --disable-bias-linear",
    "--squared-relu": "the MLP is GELU (--openai-gelu: tanh) or --swiglu; squared ReLU is " + _NOT_YET,
    "--apply-layernorm-1p": _NOT_YET,
    "--fp32-residual-connection": _NOT_YET,
    "--window-size": "sliding-window attention is " + _NOT_YET,
    "--multi-latent-attention": "multi-latent attention is " + _NOT_YET,
    # training and the schedule
    "--batch-size": "Megatron's old name: use --micro-batch-size",
    "--warmup": "Megatron's old name: use --lr-warmup-fraction",
    "--train-samples": _SAMPLES,
    "--lr-decay-samples": _SAMPLES,
    "--lr-warmup-samples": _SAMPLES,
    "--lr-warmup-init": "warmup starts from 0 (Megatron's default): " + _NOT_YET,
    "--rampup-batch-size": "batch-size ramp-up is " + _NOT_YET,
    "--start-weight-decay": "weight decay is constant (--weight-decay); an increasing one is " + _NOT_YET,
    "--end-weight-decay": "weight decay is constant (--weight-decay); an increasing one is " + _NOT_YET,
    "--weight-decay-incr-style": "weight decay is constant (--weight-decay); an increasing one is " + _NOT_YET,
    "--calculate-per-token-loss": _NOT_YET,
    "--exit-duration-in-mins": "stop after a number of iterations (--exit-interval), or send SIGTERM: it saves and "
                               "exits",
    "--exit-signal-handler": "always on: SIGTERM saves a checkpoint and exits; drop it",
    "--manual-gc": "drop it: mpzero leaves Python's garbage collector as it is",
    "--empty-unused-memory-level": _NOT_YET,
    "--deterministic-mode": _NOT_YET,
    "--yaml-cfg": "use --config FILE (YAML or JSON; its keys are flag names)",
    # checkpoints
    "--ckpt-format": _CKPT_FORMAT,
    "--use-dist-ckpt": _CKPT_FORMAT,
    "--auto-detect-ckpt-format": _CKPT_FORMAT,
    "--async-save": "saving in the background is " + _NOT_YET,
    "--no-save-optim": "a checkpoint always holds the optimizer states; load weights only with --finetune or "
                       "--no-load-optim",
    "--no-save-rng": "a checkpoint always holds the RNG states; skip them on load with --no-load-rng",
    "--use-checkpoint-args": ("give the model flags (checked against the checkpoint's at load); tools/import_hf.py "
                              "prints them for an imported model"),
    "--exit-on-missing-checkpoint": "a --load with no checkpoint trains from scratch; a damaged one stops the run",
    "--pretrained-checkpoint": "use --load DIR --finetune (weights only, a new run)",
    # data
    "--train-data-path": _DATA_SPLIT,
    "--valid-data-path": _DATA_SPLIT,
    "--test-data-path": _DATA_SPLIT,
    "--dataloader-type": "mpzero has one sampler (the global order is the same at any layout): drop it",
    "--num-workers": "samples are read from memory-mapped files in the training process: drop it",
    "--no-mmap-bin-files": "the .bin files are always memory-mapped: drop it",
    "--reset-position-ids": "resetting positions at document ends is " + _NOT_YET,
    "--reset-attention-mask": "masking attention across documents is " + _NOT_YET,
    "--eod-mask-loss": "masking the loss on end-of-document tokens is " + _NOT_YET,
    "--vocab-extra-ids": _NOT_YET,
    "--no-create-attention-mask-in-dataloader": "the causal mask is made in the model: drop it",
    # logging
    "--log-throughput": "always on: every log line gives tokens/s and TFLOP/s per rank",
    "--log-timers-to-tensorboard": _LOGGED,
    "--log-validation-ppl-to-tensorboard": _LOGGED,
    "--log-memory-to-tensorboard": _LOGGED,
    "--log-world-size-to-tensorboard": "the run's flags and world are printed at start: drop it",
    "--log-params-norm": "the parameters' norm is " + _NOT_YET + " (the gradient norm is logged)",
    "--log-num-zeros-in-grad": _NOT_YET,
    "--tensorboard-log-interval": "TensorBoard gets every --log-interval: drop it",
    "--tensorboard-queue-size": "drop it",
    "--timing-log-level": "drop it: the log line gives the iteration time",
}


def flag_name(token: str) -> str:
    """`--flag=value` -> `--flag`."""
    return token.split("=", 1)[0]


def unknown_arguments_message(unknown: list[str], known_flags: list[str]) -> str:
    """The one line for arguments argparse did not recognize: the first Megatron-LM flag's advice, else argparse's
    words with the nearest flag mpzero has."""
    flags = [flag_name(token) for token in unknown if token.startswith("--")]
    for flag in flags:
        if flag in NOT_IN_MPZERO:
            return f"{flag}: a Megatron-LM flag that mpzero does not have; {NOT_IN_MPZERO[flag]}"
    near = difflib.get_close_matches(flags[0], known_flags, n=1) if flags else []
    hint = f"; did you mean {near[0]}?" if near else ""
    return f"unrecognized arguments: {' '.join(unknown)}{hint} (see --help)"
