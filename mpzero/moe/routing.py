"""The router's arithmetic as pure functions of the logits, with Megatron-core's formulas and meanings
(megatron/core/transformer/moe/moe_utils.py): scores and the top-k choice, group-limited choice, the capacity
drop, the Switch load-balancing loss and the z-loss. Tokens are rows: [T, E] logits for T tokens and E experts.

- `top_k`: softmax scores (after the top-k by default: a softmax over the k chosen logits; before it with
  `pre_softmax`, Megatron's --moe-router-pre-softmax, over all experts) or sigmoid scores, normalised over the k
  chosen when k > 1; the expert bias (aux-loss-free balancing, sigmoid only as in Megatron) is added for the choice
  alone, the gate values come from the unbiased scores. Group-limited routing (DeepSeek's device/node-limited
  choice): the experts are cut into `num_groups` equal groups, each group scored by the sum of its top k/group_topk
  scores, and the k experts are chosen within the `group_topk` best groups. `scaling_factor` (Megatron's
  --moe-router-topk-scaling-factor, DeepSeek-V3's routed_scaling_factor): the gate values, normalised or not, are
  multiplied by it last, whatever the score function (None: not scaled).
- `drop_to_capacity`: each expert keeps at most ceil(T k / E x capacity factor) of its tokens: those with the
  highest gate ("probs") or the earliest ("position", tokens in Megatron's sequence-major order).
- `switch_aux_loss`: E coeff / (k T^2) x sum_i (sum_t p_ti) c_i (Switch Transformer's E sum_i f_i P_i with
  f_i = c_i / (T k), P_i = sum_t p_ti / T), p the softmax over all experts (sigmoid: normalised over all
  experts), c_i the tokens whose top-k (of those scores, bias and capacity aside) include expert i. The counts may
  be global and the scores local (a rank's part of the tokens): summed over the ranks, the local losses are the
  whole one. `seq_aux_loss` (DeepSeek-V2/V3): the same loss for each sequence on its own, averaged over the batch.
- `z_loss`: coeff x mean over tokens of logsumexp(logits)^2 (ST-MoE).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Routing:
    """Each token's k experts (`indices`, int64 [T, k]) and gate values (`probs` [T, k], 0 for a dropped slot);
    `kept` [T, k] False where the capacity dropped the slot."""
    indices: torch.Tensor
    probs: torch.Tensor
    kept: torch.Tensor


def top_k(logits: torch.Tensor, k: int, score_function: str = "softmax", pre_softmax: bool = False,
          num_groups: int | None = None, group_topk: int | None = None,
          expert_bias: torch.Tensor | None = None,
          scaling_factor: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate values [T, k], expert indices [T, k]) of the logits (module docstring)."""
    gates, indices = _gates(logits, k, score_function, pre_softmax, num_groups, group_topk, expert_bias)
    return (gates if scaling_factor is None else gates * scaling_factor), indices


def _gates(logits, k: int, score_function: str, pre_softmax: bool, num_groups, group_topk, expert_bias):
    if score_function == "softmax":
        if pre_softmax:
            return _choose(torch.softmax(logits, dim=-1), k, num_groups, group_topk)
        chosen, indices = _choose(logits, k, num_groups, group_topk)
        return torch.softmax(chosen, dim=-1), indices
    scores = torch.sigmoid(logits)
    if expert_bias is not None:
        _, indices = _choose((scores + expert_bias).detach(), k, num_groups, group_topk)  # the choice alone
        chosen = scores.gather(1, indices)
    else:
        chosen, indices = _choose(scores, k, num_groups, group_topk)
    return (chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20) if k > 1 else chosen), indices


def _choose(scores: torch.Tensor, k: int, num_groups: int | None, group_topk: int | None):
    if not group_topk:
        return torch.topk(scores, k=k, dim=1)
    tokens, experts = scores.shape
    # the groups only mask the choice (no gradient through them): on the graph their top-k's would keep indices
    # for a backward that never comes
    grouped = scores.detach().view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(k // group_topk, dim=-1)[0].sum(dim=-1)
    best = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best, True)
    allowed = allowed.unsqueeze(-1).expand(tokens, num_groups, experts // num_groups).reshape(tokens, experts)
    return torch.topk(scores.masked_fill(~allowed, float("-inf")), k=k, dim=1)


def capacity(tokens: int, k: int, num_experts: int, factor: float) -> int:
    """Megatron's get_capacity: ceil(T k / E x factor)."""
    return math.ceil(tokens * k / num_experts * factor)


def drop_to_capacity(probs: torch.Tensor, indices: torch.Tensor, num_experts: int, factor: float | None,
                     policy: str = "probs") -> Routing:
    """The routing with each expert's tokens beyond its capacity dropped (None factor: dropless)."""
    if factor is None:
        return Routing(indices, probs, torch.ones_like(indices, dtype=torch.bool))
    tokens, k = indices.shape
    cap = capacity(tokens, k, num_experts, factor)
    # the gates only rank the drops (off the graph: a scatter on it would keep the indices for no backward)
    dense = torch.zeros(tokens, num_experts, dtype=probs.dtype, device=probs.device).scatter(1, indices, probs.detach())
    routed = torch.zeros(tokens, num_experts, dtype=torch.bool, device=probs.device).scatter(1, indices, True)
    if cap >= tokens:
        keep = routed
    elif policy == "probs":  # each expert keeps the tokens of its `cap` highest gates
        top = torch.topk(dense.masked_fill(~routed, -1.0), k=cap, dim=0).indices
        keep = torch.zeros_like(routed).scatter(0, top, True) & routed
    else:  # "position": the first `cap` tokens routed to each expert
        keep = routed & (routed.long().cumsum(dim=0) <= cap)
    kept = keep.gather(1, indices)
    return Routing(indices, probs * kept, kept)


def aux_loss_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """The scores over all experts the load-balancing loss uses (softmax; sigmoid normalised over the experts)."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)  # in the router's dtype (fp32 logits, fp64 when asked)
    scores = torch.sigmoid(logits)
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


def routed_counts(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Tokens per expert whose top-k of `scores` include it (the loss's c_i), [E]. The choice is made on detached
    scores: a top-k on the graph would keep its indices for a backward that never comes (its values are dropped)."""
    chosen = torch.topk(scores.detach(), k, dim=1).indices
    return torch.zeros_like(scores, dtype=torch.long).scatter(1, chosen, 1).sum(0)


def switch_aux_loss(scores: torch.Tensor, counts: torch.Tensor, total_tokens: int, k: int,
                    coeff: float) -> torch.Tensor:
    """E coeff / (k T^2) x sum_i (sum_t p_ti) c_i (module docstring); `total_tokens` T counts every rank's."""
    num_experts = scores.shape[-1]
    return (scores.sum(dim=0) * counts).sum() * (num_experts * coeff / (k * total_tokens * total_tokens))


def seq_aux_loss(scores: torch.Tensor, counts: torch.Tensor, seq_tokens: int, batch: int, k: int,
                 coeff: float) -> torch.Tensor:
    """The Switch loss of each of `batch` sequences on its own, averaged: scores [s, b, E] (this rank's sequence
    positions), counts [b, E] (each sequence's, over every rank), `seq_tokens` s of every rank."""
    per_sequence = (scores.sum(dim=0) * counts).sum(dim=-1)  # [b]
    num_experts = scores.shape[-1]
    return per_sequence.sum() * (num_experts * coeff / (k * seq_tokens * seq_tokens)) / batch


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """coeff x mean(logsumexp(logits)^2) over this rank's tokens."""
    return torch.square(torch.logsumexp(logits, dim=-1)).mean() * coeff
