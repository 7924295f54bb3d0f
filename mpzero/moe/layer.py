"""The mixture-of-experts block that takes the transformer layer's MLP slot (Megatron's MoELayer): router, token
dispatcher, this rank's routed experts, and the shared experts.

    y = sum over each token's k experts of gate x expert(x)  [+ shared_experts(x)]

Tokens are routed in Megatron's order, sequence-major ([s, b] flattened), which is what the capacity's "position"
policy drops by. Under sequence parallelism (required with MoE at TP > 1, Megatron's rule) each TP rank routes its
slice; the gates and choices of the whole micro-batch are then gathered over TP, so the capacity drop, the token
counts and every rank's dispatch see the same routing as one process. With the experts split over TP (expert-TP =
TP, Megatron's default) the hidden states are gathered too and every TP rank computes its slice of every expert,
the outputs reduce-scattered back (the dense MLP's pattern); at expert-TP 1 each rank sends its own slice's tokens
over an EP group that spans the TP ranks (parallel folding) and computes whole experts.

The load-balancing loss (aux_loss: over the micro-batch; seq_aux_loss: per sequence) and the z-loss are computed
on each rank's own tokens with the micro-batch's counts, so their sum over the TP group is one process's; they
reach the objective through `MoEMetrics.attach` on the routed experts' output (metrics.py), in training only.

Context parallelism (`cp`, Megatron's tp_cp_group) splits each sequence over the CP ranks: the layer is per token, so
a rank routes and dispatches the tokens it holds (the EP group may span CP ranks: parallel folding). The counts the
load-balancing loss multiplies are summed over the CP ranks too, and its token total is theirs. Each CP rank's part
is multiplied by CP: the gradients are averaged over DP x CP (as each rank's lm loss is the mean of its own tokens),
so the average of CP x part is the sum of the parts, one process's loss; the z-loss, a mean, needs nothing.

Under --torch-compile (each transformer layer compiled, torchtitan's per-block compilation) the router, the top-k,
the auxiliary losses' arithmetic, the capacity drop and the shared experts compile; what reads the routing on the
host or keeps Python state runs eagerly as one region (`_dispatched`, a graph break via `eager_under_compile`): the
dispatch with the experts (its split sizes are host integers that change every step: compiled, they would
recompile or specialise), the figures' recording, and attaching the auxiliary losses (their backward reads the
step's scale). The compiled graphs on either side have shapes that do not depend on the routing, so nothing
recompiles as it changes (the collectives at TP or CP > 1 break the graph as in a dense layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mpzero.comm import CommGroup, eager_under_compile
from mpzero.moe.dispatch import allgather, alltoall, per_expert
from mpzero.moe.metrics import MoEMetrics
from mpzero.moe.router import TopKRouter
from mpzero.moe.routing import (Routing, aux_loss_scores, drop_to_capacity, routed_counts, seq_aux_loss,
                                switch_aux_loss, top_k, z_loss)
from mpzero.tensor_parallel import gather_from_sequence_parallel, reduce_from_tp, reduce_scatter_to_sequence_parallel


@dataclass(frozen=True)
class MoESettings:
    """How a layer routes and dispatches (the config's --moe-* values; `of(config)`)."""
    num_experts: int
    topk: int = 2
    score_function: str = "softmax"
    pre_softmax: bool = False
    num_groups: int | None = None
    group_topk: int | None = None
    load_balancing: str = "aux_loss"
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float | None = None
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    dispatcher: str = "allgather"
    scaling_factor: float | None = None  # --moe-router-topk-scaling-factor

    @staticmethod
    def of(config) -> MoESettings:
        return MoESettings(config.num_experts, config.moe_router_topk, config.moe_router_score_function,
                           config.moe_router_pre_softmax, config.moe_router_num_groups, config.moe_router_group_topk,
                           config.moe_router_load_balancing_type, config.moe_aux_loss_coeff, config.moe_z_loss_coeff,
                           config.moe_expert_capacity_factor, config.moe_token_drop_policy,
                           config.moe_token_dispatcher_type, config.moe_router_topk_scaling_factor)


def _gather(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Every rank's rows in rank order (all-gather forward, reduce-scatter backward)."""
    return gather_from_sequence_parallel(x.unsqueeze(0), group).squeeze(0)


class MoELayer(nn.Module):
    """`layer`: the global index (the metrics' row); `tp`: the TP group (sequence parallel at TP > 1); `ep` and
    `etp`: the expert-parallel and expert-TP groups; `experts`: this rank's `GroupedExperts`; `shared`: the shared
    experts' MLP or None; `sequence_parallel`: x is this TP rank's slice of the sequence (else every TP rank holds
    the whole micro-batch: inference); `cp`: the context-parallel group (None: whole sequences)."""

    def __init__(self, settings: MoESettings, layer: int, router: TopKRouter, experts: nn.Module,
                 shared: nn.Module | None, tp: CommGroup, ep: CommGroup, etp: CommGroup, metrics: MoEMetrics,
                 sequence_parallel: bool, cp: CommGroup | None = None):
        super().__init__()
        self.settings, self.layer, self.metrics = settings, layer, metrics
        self.router, self.experts, self.shared_experts = router, experts, shared
        self.tp, self.ep, self.etp = tp, ep, etp
        self.cp = cp if cp is not None and cp.size > 1 else None
        self.sp = sequence_parallel and tp.size > 1
        self._dispatch = alltoall if settings.dispatcher == "alltoall" else allgather

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        tokens = x.transpose(0, 1).reshape(-1, h)  # sequence-major, this rank's slice under SP
        logits = self.router(tokens)
        probs, indices = top_k(logits, self.settings.topk, self.settings.score_function, self.settings.pre_softmax,
                               self.settings.num_groups, self.settings.group_topk, self.router.expert_bias,
                               self.settings.scaling_factor)
        recording = self.training and torch.is_grad_enabled()
        losses = self._auxiliary_losses(logits, b) if recording else []
        routing = self._micro_batch_routing(probs, indices)
        out = self._dispatched(tokens, routing, losses, recording).view(s, b, h).transpose(0, 1)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    @eager_under_compile
    def _dispatched(self, tokens: torch.Tensor, routing: Routing, losses: list[tuple[str, torch.Tensor, torch.Tensor]],
                    recording: bool) -> torch.Tensor:
        """The experts' weighted outputs [T_local, h] with the auxiliary `losses` attached ((name, loss, the value
        the log records)), the figures recorded where `recording`: the one eager region under --torch-compile
        (module docstring)."""
        if recording:
            n = self.settings.num_experts  # dropped slots counted past the end
            counts = per_expert(torch.where(routing.kept, routing.indices, n).reshape(-1), n)
            self.metrics.record_tokens(self.layer, counts)
            self.router.count(counts)
        out = self._experts(tokens, routing)
        for name, loss, value in losses:
            self.metrics.record_loss(name, self.layer, value)
            out = self.metrics.attach(out, loss)
        return out

    def _micro_batch_routing(self, probs: torch.Tensor, indices: torch.Tensor) -> Routing:
        """The whole micro-batch's routing (gathered over TP under SP), capacity applied."""
        if self.sp:
            probs, indices = _gather(probs, self.tp), self.tp.all_gather_cat(indices.contiguous(), dim=0)
        return drop_to_capacity(probs, indices, self.settings.num_experts, self.settings.capacity_factor,
                                self.settings.drop_policy)

    def _experts(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        """This rank's tokens' weighted expert outputs [T_local, h]."""
        dispatch = lambda x, r: self._dispatch(x, r, self.experts, self.ep, self.settings.num_experts,  # noqa: E731
                                               self.metrics)
        if not self.sp:  # every TP rank holds (and routes) the same tokens: experts split over TP sum their parts
            out = dispatch(tokens, routing)
            return reduce_from_tp(out, self.tp) if self.etp.size > 1 else out
        if self.etp.size > 1:  # experts split over TP: every TP rank computes its part for all the tokens
            out = dispatch(_gather(tokens, self.tp), routing)
            return reduce_scatter_to_sequence_parallel(out.unsqueeze(0), self.tp).squeeze(0)
        mine = slice(self.tp.rank * tokens.shape[0], (self.tp.rank + 1) * tokens.shape[0])
        return dispatch(tokens, Routing(routing.indices[mine], routing.probs[mine], routing.kept[mine]))

    def _auxiliary_losses(self, logits: torch.Tensor, batch: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """This rank's parts of the load-balancing loss and the z-loss: (name, loss, the value the log records:
        divided by its coefficient, as Megatron logs it)."""
        st, sp = self.settings, self.tp.size if self.sp else 1
        cp = self.cp.size if self.cp is not None else 1
        losses = []
        if st.z_loss_coeff:
            loss = z_loss(logits, st.z_loss_coeff / sp)
            losses.append(("z_loss", loss, loss / st.z_loss_coeff))
        if st.load_balancing == "none" or not st.aux_loss_coeff:
            return losses
        scores = aux_loss_scores(logits, st.score_function)
        if st.load_balancing == "aux_loss":
            counts = self._summed(routed_counts(scores, st.topk))
            loss = switch_aux_loss(scores, counts, logits.shape[0] * sp * cp, st.topk, st.aux_loss_coeff * cp)
            name = "load_balancing_loss"
        else:  # seq_aux_loss: each sequence's own loss, averaged over the batch
            per_position = scores.view(-1, batch, st.num_experts)
            chosen = torch.zeros_like(scores, dtype=torch.long).scatter(
                1, torch.topk(scores.detach(), st.topk, dim=1).indices, 1).view(-1, batch, st.num_experts).sum(0)
            loss = seq_aux_loss(per_position, self._summed(chosen), per_position.shape[0] * sp * cp, batch,
                                st.topk, st.aux_loss_coeff * cp)
            name = "seq_load_balancing_loss"
        return losses + [(name, loss, loss / st.aux_loss_coeff)]

    def _summed(self, counts: torch.Tensor) -> torch.Tensor:
        """Counts over the micro-batch: summed over the TP group's sequence slices and the CP ranks' parts."""
        if self.sp:
            self.tp.all_reduce(counts)
        if self.cp is not None:
            self.cp.all_reduce(counts)
        return counts
