"""The mixture-of-experts flags (GPTConfig's num_experts and moe_* fields, ParallelConfig's expert grid), with
Megatron-LM's names, defaults and meanings (megatron/training/arguments.py, `_add_moe_args`); their rules are
mpzero.moe's `check_moe` and `check_expert_grid`, one line each."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from mpzero.cli.checks import CheckError, Text
from mpzero.errors import ConfigError
from mpzero.models import GPTConfig
from mpzero.moe import DISPATCHERS, parse_moe_layer_freq


@dataclass(frozen=True)
class LayerPattern(Text):
    """--moe-layer-freq's value: an integer, or a non-empty 0/1 pattern parsed by `parse_moe_layer_freq` (a config
    file's integer too)."""

    __name__ = "layer pattern"

    def __call__(self, value):
        if not (isinstance(value, int) and not isinstance(value, bool)):
            super().__call__(value)
        try:
            return parse_moe_layer_freq(value)
        except ConfigError as error:  # the parser names the flag first
            raise CheckError(str(error).removeprefix("--moe-layer-freq ")) from None


def moe_flags(p: argparse.ArgumentParser) -> None:
    """GPTConfig's MoE fields and the expert grid's sizes."""
    moe = p.add_argument_group("mixture of experts (mpzero/moe; Megatron's flags)")
    moe.add_argument("--num-experts", type=int, default=None,
                     help="routed experts per MoE layer; none: a dense model")
    moe.add_argument("--expert-model-parallel-size", type=int, default=1,
                     help="EP ranks the experts are split over, carved from the data-parallel ranks (folded into "
                          "TP x CP x DP at --expert-tensor-parallel-size 1)")
    moe.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                     help="ranks each expert is split over, like the dense MLP (default: the TP size)")
    moe.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                     help="an expert's MLP width (default: --ffn-hidden-size)")
    moe.add_argument("--moe-layer-freq", type=LayerPattern(), default=GPTConfig.moe_layer_freq,
                     help="every N-th layer is MoE (1: all), or a 0/1 per layer such as \"([1]*3+[0])*2\"")
    moe.add_argument("--moe-router-topk", type=int, default=GPTConfig.moe_router_topk,
                     help="experts each token is routed to")
    moe.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"),
                     default=GPTConfig.moe_router_score_function)
    moe.add_argument("--moe-router-pre-softmax", action="store_true",
                     help="the softmax over all experts before the top-k (default: over the k chosen logits)")
    moe.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                     help="the routed experts' gates multiplied by this after their normalisation (DeepSeek-V3's "
                          "routed_scaling_factor 2.5; default: not scaled)")
    moe.add_argument("--moe-router-num-groups", type=int, default=None,
                     help="expert groups of group-limited routing (DeepSeek's device/node limit)")
    moe.add_argument("--moe-router-group-topk", type=int, default=None,
                     help="groups each token may be routed to")
    moe.add_argument("--moe-router-load-balancing-type", choices=("aux_loss", "seq_aux_loss", "none"),
                     default=GPTConfig.moe_router_load_balancing_type,
                     help="aux_loss: the Switch loss over the micro-batch; seq_aux_loss: per sequence (DeepSeek)")
    moe.add_argument("--moe-aux-loss-coeff", type=float, default=GPTConfig.moe_aux_loss_coeff,
                     help="the load-balancing loss's coefficient (1e-2 is Megatron's recommended start)")
    moe.add_argument("--moe-z-loss-coeff", type=float, default=None,
                     help="the router z-loss's coefficient (1e-3 is Megatron's recommended start)")
    moe.add_argument("--moe-router-enable-expert-bias", action="store_true",
                     help="aux-loss-free balancing: a per-expert bias on the scores steers the choice, moved each "
                          "step toward the under-used experts (sigmoid routing)")
    moe.add_argument("--moe-router-bias-update-rate", type=float, default=GPTConfig.moe_router_bias_update_rate)
    moe.add_argument("--moe-router-dtype", choices=("fp32", "fp64"), default=None,
                     help="routing and the gates' weighted sum in this dtype (default fp32 logits)")
    moe.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                     help="the shared experts' total MLP width (every token goes through them)")
    moe.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                     help="each expert keeps at most ceil(tokens x topk / experts x factor) tokens; default dropless")
    moe.add_argument("--moe-token-drop-policy", choices=("probs", "position"),
                     default=GPTConfig.moe_token_drop_policy,
                     help="beyond capacity drop the lowest gates (probs) or the latest tokens (position)")
    moe.add_argument("--moe-token-dispatcher-type", choices=DISPATCHERS,
                     default=GPTConfig.moe_token_dispatcher_type,
                     help="alltoall: tokens to their experts' ranks by all-to-all with uneven splits; allgather: "
                          "every EP rank gathers all tokens and reduce-scatters its experts' outputs")
    moe.add_argument("--moe-grouped-gemm", action="store_true",
                     help="the local experts in one torch._grouped_mm per matrix instead of a loop of matmuls")
