"""Mixture of experts with expert parallelism: Megatron's MoE layer in the transformer layer's MLP slot (router,
top-k routing with its auxiliary losses, the allgather and alltoall token dispatchers, stacked experts as a grouped
GEMM or a loop, shared experts), the flags' rules, and the shared record the layers keep for the log."""

from mpzero.moe.checks import check_expert_grid, check_moe, parse_moe_layer_freq
from mpzero.moe.dispatch import DISPATCHERS, balanced_counts, balanced_routing
from mpzero.moe.experts import GroupedExperts, experts_impl
from mpzero.moe.layer import MoELayer, MoESettings
from mpzero.moe.metrics import MoEMetrics
from mpzero.moe.report import moe_log, moe_metrics, training_iteration
from mpzero.moe.router import TopKRouter, expert_biases, restore_expert_biases
from mpzero.moe.routing import (Routing, aux_loss_scores, capacity, drop_to_capacity, routed_counts, seq_aux_loss,
                                switch_aux_loss, top_k, z_loss)

__all__ = ["balanced_counts", "balanced_routing", "check_expert_grid", "check_moe", "parse_moe_layer_freq",
           "DISPATCHERS", "GroupedExperts", "experts_impl", "MoELayer", "MoESettings", "MoEMetrics", "moe_log",
           "moe_metrics", "training_iteration", "TopKRouter", "expert_biases", "restore_expert_biases", "Routing",
           "aux_loss_scores", "capacity", "drop_to_capacity", "routed_counts", "seq_aux_loss", "switch_aux_loss",
           "top_k", "z_loss"]
