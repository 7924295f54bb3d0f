"""The mixture-of-experts flags' rules (Megatron's, from its arguments.py and TransformerConfig), each one
ConfigError line naming the flag and what to do; and --moe-layer-freq's value, read without evaluating it."""

from __future__ import annotations

import ast

from mpzero.errors import ConfigError
from mpzero.moe.dispatch import DISPATCHERS

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
DROP_POLICIES = ("probs", "position")
ROUTER_DTYPES = ("fp32", "fp64")


def parse_moe_layer_freq(text: str | int) -> int | tuple[int, ...]:
    """--moe-layer-freq: an integer N (every N-th layer, from the first), or a pattern of 0/1 per layer as Megatron
    writes it: a list, list times integer and lists added ("[1,0]*2", "([0]+[1]*23)"). Parsed, never evaluated."""
    if isinstance(text, int) and not isinstance(text, bool):  # a config file's integer
        return text
    try:
        if not isinstance(text, str):
            raise ValueError("not text")
        value = _pattern(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ConfigError(f"--moe-layer-freq {_shown(text)} is neither an integer nor a 0/1 pattern such as "
                          f"\"([1]*3+[0])*2\" (at most {MAX_PATTERN} layers)") from None
    if isinstance(value, list):
        if not value or any(v not in (0, 1) for v in value):
            raise ConfigError(f"--moe-layer-freq {_shown(text)}: a pattern holds 0 (dense) or 1 (MoE) per layer")
        return tuple(value)
    return value


MAX_PATTERN = 100_000  # layers a --moe-layer-freq pattern may spell out


def _shown(text) -> str:
    """The value as an error line quotes it: a long one cut short."""
    shown = repr(text)
    return shown if len(shown) <= 80 else shown[:60] + "...'"


def _pattern(node):
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_pattern(item) for item in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern(node.left), _pattern(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right
        if isinstance(node.op, ast.Mult) and isinstance(left, list) != isinstance(right, list):
            items, times = (left, right) if isinstance(left, list) else (right, left)
            if len(items) * times > MAX_PATTERN:
                raise ValueError("too long")
            return items * times
        if isinstance(left, list) and isinstance(right, list) and len(left) + len(right) > MAX_PATTERN:
            raise ValueError("too long")
    raise ValueError("not a pattern")


def check_moe(config, tp_size: int) -> None:
    """The MoE flags of a transformer config (GPTConfig) at TP size `tp_size` (what depends on the expert grid is
    `check_expert_grid`'s)."""
    if config.num_experts is None:
        _no_moe_flags(config)
        return
    e, k = config.num_experts, config.moe_router_topk
    if e < 1:
        raise ConfigError(f"--num-experts {e} must be positive (omit it for a dense model)")
    if not 1 <= k <= e:
        raise ConfigError(f"--moe-router-topk {k} must lie between 1 and --num-experts {e}")
    for flag, value, choices in (("--moe-router-score-function", config.moe_router_score_function, SCORE_FUNCTIONS),
                                 ("--moe-router-load-balancing-type", config.moe_router_load_balancing_type,
                                  LOAD_BALANCING_TYPES),
                                 ("--moe-token-drop-policy", config.moe_token_drop_policy, DROP_POLICIES),
                                 ("--moe-token-dispatcher-type", config.moe_token_dispatcher_type, DISPATCHERS)):
        if value not in choices:
            raise ConfigError(f"{flag} {value} is not one of {', '.join(choices)}")
    if config.moe_router_dtype is not None and config.moe_router_dtype not in ROUTER_DTYPES:
        raise ConfigError(f"--moe-router-dtype {config.moe_router_dtype} is not one of {', '.join(ROUTER_DTYPES)}")
    _check_sizes(config, tp_size)
    _check_router(config)
    if config.context_parallel_size > 1 and config.moe_expert_capacity_factor is not None:
        raise ConfigError("--moe-expert-capacity-factor with --context-parallel-size > 1 is not supported yet: the "
                          "capacity drop ranks a whole micro-batch's tokens, which CP splits over ranks; drop it "
                          "(dropless) or use CP 1")


def _no_moe_flags(config) -> None:
    if config.moe_ffn_hidden_size is not None:
        raise ConfigError("--moe-ffn-hidden-size needs --num-experts (a dense model has no experts)")
    if config.moe_shared_expert_intermediate_size is not None:
        raise ConfigError("--moe-shared-expert-intermediate-size needs --num-experts")
    if config.moe_router_topk_scaling_factor is not None:
        raise ConfigError("--moe-router-topk-scaling-factor needs --num-experts")


def _check_sizes(config, tp_size: int) -> None:
    freq = config.moe_layer_freq
    if isinstance(freq, tuple) and len(freq) != config.num_layers:
        raise ConfigError(f"--moe-layer-freq has {len(freq)} entries for --num-layers {config.num_layers}: give one "
                          f"0/1 per layer")
    if isinstance(freq, int) and freq < 1:
        raise ConfigError(f"--moe-layer-freq {freq} must be a positive integer or a 0/1 pattern")
    if config.expert_ffn_size < 1:
        raise ConfigError(f"--moe-ffn-hidden-size {config.expert_ffn_size} must be positive")
    shared = config.moe_shared_expert_intermediate_size
    if shared is not None and (shared < 1 or shared % tp_size):
        raise ConfigError(f"--moe-shared-expert-intermediate-size {shared} must be positive and divisible by "
                          f"--tensor-model-parallel-size {tp_size}")
    factor = config.moe_expert_capacity_factor
    if factor is not None and factor <= 0:
        raise ConfigError(f"--moe-expert-capacity-factor {factor} must be positive (omit it for dropless routing)")
    if config.moe_aux_loss_coeff < 0 or (config.moe_z_loss_coeff or 0) < 0:
        raise ConfigError("--moe-aux-loss-coeff and --moe-z-loss-coeff must not be negative")


def _check_router(config) -> None:
    e, k = config.num_experts, config.moe_router_topk
    if k == 1 and config.moe_router_score_function == "softmax" and not config.moe_router_pre_softmax:
        raise ConfigError("--moe-router-topk 1 with the softmax score function needs --moe-router-pre-softmax (a "
                          "softmax over one chosen logit is 1, with a zero gradient: Megatron's rule)")
    if config.moe_router_enable_expert_bias and config.moe_router_score_function != "sigmoid":
        raise ConfigError("--moe-router-enable-expert-bias supports the sigmoid score function only (Megatron's "
                          "rule): add --moe-router-score-function sigmoid")
    scaling = config.moe_router_topk_scaling_factor
    if scaling is not None and not scaling > 0:
        raise ConfigError(f"--moe-router-topk-scaling-factor {scaling} must be positive (omit it for gates unscaled)")
    if config.moe_router_bias_update_rate < 0:
        raise ConfigError(f"--moe-router-bias-update-rate {config.moe_router_bias_update_rate} must not be negative")
    groups, group_topk = config.moe_router_num_groups, config.moe_router_group_topk
    if group_topk is None:
        if groups is not None:
            raise ConfigError("--moe-router-num-groups needs --moe-router-group-topk (the groups each token uses)")
        return
    if not groups:
        raise ConfigError("--moe-router-group-topk needs --moe-router-num-groups (group-limited routing)")
    if e % groups:
        raise ConfigError(f"--num-experts {e} is not divisible by --moe-router-num-groups {groups}")
    if not 1 <= group_topk <= groups:
        raise ConfigError(f"--moe-router-group-topk {group_topk} must lie between 1 and --moe-router-num-groups "
                          f"{groups}")
    if k % group_topk or k // group_topk > e // groups:
        raise ConfigError(f"--moe-router-topk {k} must be a multiple of --moe-router-group-topk {group_topk}, "
                          f"with at most {e // groups} experts per group")


def check_expert_grid(config, ep_size: int, etp_size: int) -> None:
    """The MoE config against its expert-parallel and expert-TP sizes (the model's build)."""
    if config.num_experts is None:
        if ep_size > 1:
            raise ConfigError(f"--expert-model-parallel-size {ep_size} needs --num-experts (num_experts must be set "
                              f"to use expert model parallelism)")
        return
    if config.num_experts % ep_size:
        raise ConfigError(f"--num-experts {config.num_experts} is not a multiple of --expert-model-parallel-size "
                          f"{ep_size}: each EP rank holds the same number of experts")
    if config.expert_ffn_size % etp_size:
        raise ConfigError(f"--moe-ffn-hidden-size {config.expert_ffn_size} is not divisible by "
                          f"--expert-tensor-parallel-size {etp_size}")
    if config.add_bias_linear and etp_size > 1:
        raise ConfigError(f"biases in the experts (GPT-2's linears; drop them with --disable-bias-linear) need "
                          f"--expert-tensor-parallel-size 1, not {etp_size} (Megatron's rule)")
