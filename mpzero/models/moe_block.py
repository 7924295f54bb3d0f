"""The transformer layer's MLP slot filled with a mixture of experts (`mpzero.moe.MoELayer`), built from a config:
the router, this expert-parallel rank's experts (SwiGLU or GELU like the dense MLP, biases as --add-bias-linear
says), and the shared experts as a dense MLP of --moe-shared-expert-intermediate-size split over TP (Megatron's
SharedExpertMLP)."""

from __future__ import annotations

from dataclasses import dataclass

from mpzero.comm import CommGroup
from mpzero.models.blocks import MLP
from mpzero.moe import GroupedExperts, MoELayer, MoEMetrics, MoESettings, TopKRouter
from mpzero.tensor_parallel import InitMethod


@dataclass(frozen=True)
class ExpertGrid:
    """What a model's MoE layers share: the expert-parallel and expert-TP groups, the metrics record, and the
    context-parallel group the load-balancing loss's counts are summed over (None: whole sequences)."""
    ep: CommGroup
    etp: CommGroup
    metrics: MoEMetrics
    cp: CommGroup | None = None


def moe_block(config, layer: int, tp: CommGroup, grid: ExpertGrid, init: InitMethod, output_init: InitMethod,
              activation) -> MoELayer:
    """Layer `layer`'s mixture of experts (its global index names its experts' initial weights)."""
    h, e, ep = config.hidden_size, config.num_experts, grid.ep
    local = e // ep.size
    sp = config.sequence_parallel
    router = TopKRouter(h, e, init, config.moe_router_dtype, config.moe_router_enable_expert_bias,
                        tp if sp and tp.size > 1 else None)
    experts = GroupedExperts(h, config.expert_ffn_size, range(ep.rank * local, (ep.rank + 1) * local), grid.etp,
                             init, output_init, activation=activation, gated=config.swiglu,
                             bias=config.add_bias_linear, grouped_gemm=config.moe_grouped_gemm)
    shared = None
    if config.moe_shared_expert_intermediate_size:
        shared = MLP(h, config.moe_shared_expert_intermediate_size, tp, init, output_init, activation=activation,
                     gated=config.swiglu, bias=config.add_bias_linear, sequence_parallel=sp)
    return MoELayer(MoESettings.of(config), layer, router, experts, shared, tp, ep, grid.etp, grid.metrics, sp,
                    grid.cp)
