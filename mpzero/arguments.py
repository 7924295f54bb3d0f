"""Command-line flags with Megatron-LM's names and defaults, turned into the typed config sections
each component receives. One name per knob: the flag `--hidden-size` is `GPTConfig.hidden_size`."""

from __future__ import annotations

import argparse

from mpzero.errors import ConfigError
from mpzero.models import GPTConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pretrain_gpt.py", description="Pretrain a GPT with TP x ZeRO-DP.",
                                allow_abbrev=False)
    model = p.add_argument_group("model")
    model.add_argument("--num-layers", type=int, required=True)
    model.add_argument("--hidden-size", type=int, required=True)
    model.add_argument("--num-attention-heads", type=int, required=True)
    model.add_argument("--seq-length", type=int, required=True)
    model.add_argument("--max-position-embeddings", type=int, default=None,
                       help="default: --seq-length")
    model.add_argument("--hidden-dropout", type=float, default=0.1)
    model.add_argument("--attention-dropout", type=float, default=0.1)
    model.add_argument("--init-method-std", type=float, default=0.02)
    model.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    model.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    model.add_argument("--recompute-activations", action="store_true")

    par = p.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1)
    par.add_argument("--distributed-timeout-minutes", type=float, default=10.0)

    train = p.add_argument_group("training")
    train.add_argument("--micro-batch-size", type=int, required=True)
    train.add_argument("--global-batch-size", type=int, default=None,
                       help="default: micro batch size x data-parallel size")
    train.add_argument("--train-iters", type=int, required=True)
    train.add_argument("--lr", type=float, required=True)
    train.add_argument("--weight-decay", type=float, default=0.01)
    train.add_argument("--adam-beta1", type=float, default=0.9)
    train.add_argument("--adam-beta2", type=float, default=0.999)
    train.add_argument("--adam-eps", type=float, default=1e-8)
    train.add_argument("--clip-grad", type=float, default=1.0)
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument("--log-interval", type=int, default=100)

    data = p.add_argument_group("data")
    data.add_argument("--mock-data", action="store_true", help="train on deterministic random tokens")
    data.add_argument("--vocab-size", type=int, default=None, help="vocabulary size for --mock-data")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.mock_data and args.vocab_size is None:
        raise ConfigError("--mock-data needs --vocab-size")
    if not args.mock_data:
        raise ConfigError("no data: pass --mock-data --vocab-size N")
    for flag in ("micro_batch_size", "train_iters", "log_interval", "tensor_model_parallel_size"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.seq_length > args.max_position_embeddings:
        raise ConfigError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                          f"{args.max_position_embeddings}")
    return args


def gpt_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads, vocab_size=args.vocab_size,
                     max_position_embeddings=args.max_position_embeddings, hidden_dropout=args.hidden_dropout,
                     attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
                     layernorm_epsilon=args.layernorm_epsilon,
                     make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                     recompute_activations=args.recompute_activations)
