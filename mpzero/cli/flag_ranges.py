"""The range of every numeric flag, checked once at start: finite, positive where it must be, and consistent
with the others. argparse's `float` accepts "nan" and "inf" and its `int` any sign; left unchecked they
train a whole run at learning rate 0, or fail with a ZeroDivisionError at the end. One line per problem.
"""

from __future__ import annotations

import argparse

from mpzero.cli.checks import CheckError, Number
from mpzero.errors import ConfigError
from mpzero.optim import RULES

# dest: (lowest, lowest allowed?, highest, highest allowed?); None: unbounded on that side. Every float is finite.
RANGES = {
    "num_layers": (1, True, None, False), "hidden_size": (1, True, None, False),
    "num_attention_heads": (1, True, None, False), "seq_length": (1, True, None, False),
    "max_position_embeddings": (1, True, None, False), "make_vocab_size_divisible_by": (1, True, None, False),
    "hidden_dropout": (0.0, True, 1.0, False), "attention_dropout": (0.0, True, 1.0, False),
    "init_method_std": (0.0, False, None, False), "layernorm_epsilon": (0.0, False, None, False),
    "tensor_model_parallel_size": (1, True, None, False), "context_parallel_size": (1, True, None, False),
    "distributed_timeout_minutes": (0.0, False, None, False),
    "pipeline_model_parallel_size": (1, True, None, False),
    "num_virtual_stages_per_pipeline_rank": (1, True, None, False),
    "num_layers_per_virtual_pipeline_stage": (1, True, None, False),
    "decoder_first_pipeline_num_layers": (1, True, None, False),
    "decoder_last_pipeline_num_layers": (1, True, None, False),
    "zero_bucket_numel": (1, True, None, False),
    "loss_scale": (0.0, False, None, False), "initial_loss_scale": (0.0, False, None, False),
    "min_loss_scale": (0.0, False, None, False), "loss_scale_window": (1, True, None, False),
    "hysteresis": (1, True, None, False),
    "micro_batch_size": (1, True, None, False), "global_batch_size": (1, True, None, False),
    "train_iters": (1, True, None, False), "lr": (0.0, True, None, False), "min_lr": (0.0, True, None, False),
    "weight_decay": (0.0, True, None, False), "clip_grad": (0.0, True, None, False),
    "seed": (0, True, 2 ** 32, False), "log_interval": (1, True, None, False),
    "lr_decay_iters": (1, True, None, False), "lr_warmup_iters": (0, True, None, False),
    "lr_warmup_fraction": (0.0, True, 1.0, True), "exit_interval": (1, True, None, False),
    "eval_interval": (1, True, None, False), "eval_iters": (0, True, None, False),
    "save_interval": (1, True, None, False), "vocab_size": (1, True, None, False),
    "offload_sub_group_numel": (1, True, None, False), "offload_buffer_count": (3, True, None, False),
    "offload_delayed_update_after": (0, True, None, False),
    "recompute_num_layers": (1, True, None, False), "cross_entropy_chunk_size": (0, True, None, False),
    "ffn_hidden_size": (1, True, None, False), "num_query_groups": (1, True, None, False),
    "kv_channels": (1, True, None, False),
    "rotary_base": (1, True, None, False), "rotary_percent": (0.0, False, 1.0, True),
    "world_size": (1, True, None, False), "rank": (0, True, None, False),
    "profile_step_start": (0, True, None, False), "profile_step_end": (1, True, None, False),
    "profile_ranks": (0, True, None, False),  # each of them
    "num_layers_at_start_in_bf16": (0, True, None, False), "num_layers_at_end_in_bf16": (0, True, None, False),
    "num_experts": (1, True, None, False), "expert_model_parallel_size": (1, True, None, False),
    "expert_tensor_parallel_size": (1, True, None, False), "moe_ffn_hidden_size": (1, True, None, False),
    "moe_router_topk": (1, True, None, False), "moe_router_num_groups": (1, True, None, False),
    "moe_router_group_topk": (1, True, None, False), "moe_aux_loss_coeff": (0.0, True, None, False),
    "moe_z_loss_coeff": (0.0, True, None, False), "moe_router_bias_update_rate": (0.0, True, None, False),
    "moe_shared_expert_intermediate_size": (1, True, None, False),
    "moe_expert_capacity_factor": (0.0, False, None, False),
    "moe_router_topk_scaling_factor": (0.0, False, None, False),
    **{dest: bounds for rule in RULES.values() for dest, bounds in rule.flag_ranges.items()},  # each rule's own
}


def number(dest: str, kind: type) -> Number:
    """The flag's checked type (mpzero/cli/checks.py): `kind` within RANGES[dest]; any finite value if unlisted."""
    low, low_ok, high, high_ok = RANGES.get(dest, (None, True, None, False))
    return Number(kind, low, low_ok, high, high_ok)


def check_ranges(args: argparse.Namespace) -> None:
    """Every numeric value in range, however it was set (command line, --config, a default), then the ranges
    that depend on each other."""
    for dest, bounds in RANGES.items():
        value = getattr(args, dest)
        for item in value if isinstance(value, list) else [value]:  # a flag with nargs: each of its values
            if item is None:
                continue
            try:
                Number(type(item), *bounds).check(item)
            except CheckError as error:
                raise ConfigError(f"--{dest.replace('_', '-')} {error}") from None
    _check_consistency(args)


def _check_consistency(args: argparse.Namespace) -> None:
    if args.min_lr > args.lr:
        raise ConfigError(f"--min-lr {args.min_lr} is above --lr {args.lr}")
    if args.min_loss_scale > args.initial_loss_scale:
        raise ConfigError(f"--min-loss-scale {args.min_loss_scale} is above --initial-loss-scale "
                          f"{args.initial_loss_scale}")
    if args.lr_warmup_iters > args.train_iters:
        raise ConfigError(f"--lr-warmup-iters {args.lr_warmup_iters} is longer than the run (--train-iters "
                          f"{args.train_iters}): the learning rate would never reach --lr")


def check_rule_flags(args: argparse.Namespace) -> None:
    """A hyperparameter of an update rule this run does not use, set to other than its default (--sgd-momentum
    with --optimizer adam, --adam-beta1 or --adam-eps with sgd), is one line: the run would ignore it. Each rule's
    flags are its own `add_flags`, so a new rule is covered without a list here."""
    for name, rule in RULES.items():
        if name == args.optimizer:
            continue
        own = argparse.ArgumentParser(add_help=False)
        rule.add_flags(own.add_argument_group())
        for action in own._actions:
            value = getattr(args, action.dest, action.default)
            if value != action.default:
                raise ConfigError(f"{action.option_strings[0]} {value} is --optimizer {name}'s, and this run's "
                                  f"--optimizer is {args.optimizer}, which would ignore it: drop it, or use "
                                  f"--optimizer {name}")


def check_in_ranges(values: dict, flags: dict[str, str], where: str) -> None:
    """Each key of `flags` ({key: the flag's dest its value becomes}) that `values` sets to a number, within that
    flag's range (a Hugging Face config.json's values, say): one line naming the key and the flag otherwise."""
    for key, dest in flags.items():
        value = values.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # unset, or another type: the reader's type check refuses that
        try:
            Number(type(value), *RANGES[dest]).check(value)
        except CheckError as error:
            raise ConfigError(f"{where}: {key} {error} (it becomes --{dest.replace('_', '-')})") from None
