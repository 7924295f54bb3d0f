"""Import a Megatron-LM / megatron-core GPT checkpoint (torch_dist format, any TP x PP) as an mpzero checkpoint.

    python tools/import_megatron.py --load megatron/checkpoints --save checkpoints/from-megatron \
        --num-attention-heads 32 [--position-embedding-type rope --max-position-embeddings 4096 ...]
    torchrun --nproc_per_node 4 pretrain_gpt.py --load checkpoints/from-megatron --finetune ...  # the flags it prints

Reads Megatron-LM's --save directory (the iteration latest_checkpointed_iteration.txt names, or --ckpt-step), or
one saved iteration directory: DCP's metadata and the model's tensors, every TP and PP shard of each. GPT-2-shaped
(LayerNorm, GELU, learned positions, biases) and LLaMA-shaped (RMSNorm, SwiGLU, RoPE, grouped-query attention, no
biases, untied output) models import, from TE or local layer specs. The layers, widths, head size (--kv-channels),
key/value groups and those choices come from the tensors; --num-attention-heads, and for RoPE
--max-position-embeddings, --rotary-base and --rotary-percent, from you (Megatron's flag names and defaults); any
other model flag you pass is checked against the tensors. --vocab-size drops Megatron's padding rows. The run's
common.pt (a pickle) is never opened.
Writes a weights-only checkpoint (iteration 0) that `pretrain_gpt.py --load ... --finetune` continues at any
TP x DP x ZeRO layout with the same logits, and that tools/generate.py and tools/export_hf.py read. Anything else
(the legacy torch format, MoE, QK layernorm, MLA, a flag the tensors contradict, a Megatron flag mpzero's GPT does
not compute such as --apply-layernorm-1p) is one `error:` line and exit code 2; --save appears complete or not at
all.
"""

from __future__ import annotations

import sys

from mpzero.checkpointing.imported import check_import_destination, write_imported
from mpzero.checkpointing.verify import single_process
from mpzero.cli import INPUT_ERRORS, ITERATION, Number, Parser, Path, exit_code
from mpzero.errors import ConfigError
from mpzero.inference import megatron, megatron_files
from mpzero.models import NORMALIZATIONS, POSITION_EMBEDDINGS

POSITIVE = Number(int, low=1)
CHECKED = "checked against the tensors (default: what they say)"
# the model flags a user may pass (Megatron's names), by GPTConfig field: (flag, type or choices, help); a switch
# has no type
MODEL_FLAGS = {
    "num_layers": ("--num-layers", POSITIVE, CHECKED), "hidden_size": ("--hidden-size", POSITIVE, CHECKED),
    "ffn_hidden_size": ("--ffn-hidden-size", POSITIVE, CHECKED),
    "num_query_groups": ("--num-query-groups", POSITIVE, CHECKED),
    "kv_channels": ("--kv-channels", POSITIVE, CHECKED + ": linear_proj's columns / heads"),
    "normalization": ("--normalization", NORMALIZATIONS, CHECKED + ": a LayerNorm has a bias, an RMSNorm none"),
    "swiglu": ("--swiglu", None, CHECKED + ": linear_fc1 twice linear_fc2's width"),
    "untie_embeddings_and_output_weights": ("--untie-embeddings-and-output-weights", None,
                                            CHECKED + ": an output_layer.weight of its own"),
    "position_embedding_type": ("--position-embedding-type", POSITION_EMBEDDINGS,
                                "learned_absolute where the checkpoint holds a position table; rope or none, which "
                                "the tensors cannot tell apart, must be given"),
    "max_position_embeddings": ("--max-position-embeddings", POSITIVE,
                                "learned positions: checked against the table; RoPE or none: required"),
    "vocab_size": ("--vocab-size", POSITIVE, "the tokenizer's vocabulary: embedding rows past it (Megatron's "
                                             "padding) are dropped; default: every stored row"),
    "openai_gelu": ("--openai-gelu", None, "GELU's tanh form, if the model was trained with it (the tensors "
                                           "cannot tell)")}
# Megatron's model flags that change what the weights mean, which mpzero's GPT does not compute and most of which
# the tensors cannot show: refused by name, for a user who passes the flags the model was trained with
REFUSED = {"--apply-layernorm-1p": "zero-centered norm weights (weight + 1)",
           "--apply-residual-connection-post-layernorm": "the residual taken after the norm",
           "--squared-relu": "a squared-ReLU MLP", "--rotary-interleaved": "interleaved RoPE",
           "--qk-layernorm": "QK layernorm", "--add-qkv-bias": "a QKV bias without the other linears' biases"}


def import_megatron(args) -> str:
    """Writes the checkpoint under args.save; returns the lines to print. Everything is checked before writing."""
    for flag, what in REFUSED.items():
        if getattr(args, flag[2:].replace("-", "_")):
            raise ConfigError(f"{flag}: mpzero's GPT does not compute {what}, so a model trained with it does not "
                              f"import")
    directory = megatron_files.checkpoint_directory(args.load, args.ckpt_step)
    source = f"--load {directory}"
    metadata = megatron_files.read_metadata(directory)
    plan = megatron.Plan(metadata, source)
    config = megatron.megatron_config(plan, _given(args))
    megatron.check_plan(plan, config)
    check_import_destination(args.save, {"--load": args.load})
    keys = sorted({key for entries in plan.sources.values() for key, _ in entries})
    stored = megatron_files.read_tensors(directory, metadata, keys)
    weights = megatron.weights_from(plan, stored, config)
    write_imported(args.save, weights, megatron.model_flags(config), {})
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in stored.values()})
    masters = "" if dtypes == ["float32"] else "; the optimizer's fp32 master copies are not read"
    size = sum(t.numel() for t in weights.values())
    return (f"imported {directory} ({size:,} parameters stored as {', '.join(dtypes)}) to {args.save} "
            f"(iteration 0, weights only, fp32{masters})\n"
            f"train from it: pretrain_gpt.py --load {args.save} --finetune {' '.join(megatron.command_line(config))} "
            f"--seq-length N and the Megatron run's --tokenizer-* flags ...")


def _given(args) -> dict:
    """The model flags passed, by GPTConfig field (a switch only when on)."""
    given = {field: getattr(args, field) for field in MODEL_FLAGS if getattr(args, field) not in (None, False)}
    if args.disable_bias_linear:
        given["add_bias_linear"] = False
    return {**given, "num_attention_heads": args.num_attention_heads, "layernorm_epsilon": args.norm_epsilon,
            "rotary_base": float(args.rotary_base), "rotary_percent": args.rotary_percent}


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--load", type=Path("dir"), required=True,
                   help="Megatron-LM's --save directory, or one saved iteration directory (iter_0000100)")
    p.add_argument("--ckpt-step", type=ITERATION, default=None,
                   help="the iteration to import (default: the one latest_checkpointed_iteration.txt names)")
    p.add_argument("--save", type=Path("dir", exists=False, writable=True), required=True,
                   help="a new directory for the mpzero checkpoint")
    p.add_argument("--num-attention-heads", type=POSITIVE, required=True, help="as the model was trained")
    for field, (flag, kind, text) in MODEL_FLAGS.items():
        if kind is None:
            p.add_argument(flag, dest=field, action="store_true", help=text)
        elif isinstance(kind, tuple):
            p.add_argument(flag, dest=field, choices=kind, default=None, help=text)
        else:
            p.add_argument(flag, dest=field, type=kind, default=None, help=text)
    p.add_argument("--group-query-attention", action="store_true",
                   help="accepted as in Megatron; the key/value groups are read from linear_qkv's rows")
    p.add_argument("--disable-bias-linear", action="store_true", help=CHECKED + ": no linear_qkv.bias")
    for flag, what in REFUSED.items():
        p.add_argument(flag, action="store_true", help=f"refused: {what} (mpzero's GPT does not compute it)")
    p.add_argument("--norm-epsilon", "--layernorm-epsilon", dest="norm_epsilon", type=Number(float, low=0.0),
                   default=1e-5, help="the norms' epsilon (Megatron's default 1e-5)")
    p.add_argument("--rotary-base", type=POSITIVE, default=10000, help="RoPE's theta (Megatron's default 10000)")
    p.add_argument("--rotary-percent", type=Number(float, low=0.0, low_ok=False, high=1.0, high_ok=True),
                   default=1.0, help="the share of each head's features RoPE rotates")
    args = p.parse_args(argv)
    with single_process():  # no process group here: DCP's warning about that says nothing
        return exit_code(lambda: print(import_megatron(args), flush=True), INPUT_ERRORS)


if __name__ == "__main__":
    sys.exit(main())
