"""The routing a plan states for a mixture of experts, and what it decides: rows into each rank's experts and the
expert-parallel bytes per iteration.

Routing is data-dependent, so a plan names the routing it assumes:
- dropless worst case: every slot of the EP group's tokens that can reach this rank's experts does (R = EP D
  min(k, E_l); with a capacity factor at most EP E_l ceil(s b k / E x factor)): the activation bound the planner
  fits the device with (`mpzero.activations.moe.worst_case_rows`);
- balanced: slot i of each rank's D k slots goes to expert i mod E (`mpzero.moe.balanced_counts`), every expert its
  share, D k / E slots from each rank; R = EP x the slots of this rank's experts. The planner prints the activations
  at this routing beside the bound, and states the EP bytes at it; `pretrain_gpt.py --dry-run` routes so (its
  tensors hold no data to route by), which makes its counted lines comparable with these figures.

EP bytes per iteration, as the dispatchers count them (`mpzero.moe.dispatch`; the `moe comm` line's formula at the
balanced counts), per MoE layer and micro-batch, e the activations' bytes, r the router's:
  alltoall   rows sent to and received from other ranks, forward and mirrored in backward: 2 e h (D k - S_me +
             (EP - 1) S_me), S_me the slots of this rank's own experts; plus the counts' exchange 8 (E - E_l)
  allgather  each gather and scatter moves the other EP - 1 ranks' D tokens: D (EP - 1) (2 (2 e h + r k) + 9 k)
A forward without gradients (full recomputation's first pass) moves the rows once; its replay again, mirrored.
"""

from __future__ import annotations

from mpzero.activations import dispatched_tokens, moe_shape, worst_case_rows
from mpzero.moe import balanced_counts, experts_impl

ROUTINGS = ("worst", "balanced")


def plan_moe_shape(config, tp: int, ep: int, etp: int | None):
    """The activation module's `MoEShape` of `config` at EP `ep` and expert-TP `etp` (None: TP), as the model
    sets it; None for a dense model."""
    if not config.num_experts:
        return None
    return moe_shape(config, ep, tp if etp is None else etp, experts_impl(config.moe_grouped_gemm) == "grouped_mm")


def balanced_rows(setting, ep_rank: int = 0) -> dict[int, tuple[int, int]]:
    """{MoE layer: (R, S)} of EP rank `ep_rank` at balanced routing (module docstring), for an activation setting
    whose `moe` is set; rank 0 receives the most where D k is not a multiple of E."""
    moe = setting.moe
    d = dispatched_tokens(setting, moe)
    local = moe.local_experts
    mine = sum(balanced_counts(d * moe.topk, moe.num_experts)[ep_rank * local:(ep_rank + 1) * local])
    return {layer: (moe.ep * mine, d * moe.topk) for layer in moe.layers}


def routing_text(setting, ep_rank: int = 0, planned: str = "worst") -> str:
    """What the plan assumes, in words: the worst case's and the balanced routing's rows (R) per MoE layer, and
    which of them the activations are `planned` at."""
    moe = setting.moe
    worst = worst_case_rows(setting, moe)
    bound = "worst case at capacity" if moe.capacity_factor is not None else "dropless worst case"
    rows = next(iter(balanced_rows(setting, ep_rank).values()))[0]
    marks = {"worst": " (planned)", "balanced": ""} if planned == "worst" else {"worst": "", "balanced": " (planned)"}
    return (f"routing: {bound} R {worst} rows into a rank's experts per MoE layer{marks['worst']}; balanced "
            f"(tokens x topk / E per expert) R {rows}{marks['balanced']}")


def ep_comm_bytes(setting, micro_batches: int, recomputed: frozenset = frozenset(), ep_rank: int = 0) -> float:
    """EP bytes per iteration of EP rank `ep_rank` at balanced routing (module docstring); `setting`: an activation
    setting with `moe` (a pipeline rank's: its layers), `recomputed`: the MoE layers full recomputation replays."""
    moe = setting.moe
    if moe is None or moe.ep == 1:
        return 0.0
    d, k, h, e, ep = dispatched_tokens(setting, moe), moe.topk, setting.hidden_size, setting.dtype_bytes, moe.ep
    total = 0.0
    for layer in (i for i in setting.layer_indices if i in moe.layers):
        passes = (1, 2) if layer in recomputed else (2,)  # the rows mirrored in backward only where it has grad
        if moe.dispatcher == "alltoall":
            send = balanced_counts(d * k, moe.num_experts)
            own = sum(send[ep_rank * moe.local_experts:(ep_rank + 1) * moe.local_experts])
            rows = d * k - own + (ep - 1) * own
            total += sum(rows * h * e * mirrored + (moe.num_experts - moe.local_experts) * 8 for mirrored in passes)
        else:
            r = moe.router_bytes
            total += sum(d * (ep - 1) * ((2 * h * e + k * r) * mirrored + 9 * k) for mirrored in passes)
    return total * micro_batches


def recomputed_layers(config, stage=None) -> frozenset:
    """The layers full recomputation replays on a pipeline rank's `stage` (None: the whole model): every layer
    (uniform), or the first --recompute-num-layers of each model chunk (block)."""
    if config.granularity != "full":
        return frozenset()
    chunks = [tuple(range(config.num_layers))] if stage is None else stage.chunks
    if config.resolved_recompute_method == "uniform":
        return frozenset(i for chunk in chunks for i in chunk)
    return frozenset(i for chunk in chunks for i in tuple(chunk)[:config.resolved_recompute_num_layers])


def moe_tp_comm_bytes(config, tp: int, micro_batch: int, seq: int, p: int, micro_batches: int, stage=None,
                      etp: int | None = None) -> float:
    """What the MoE layers change in the transformer's TP bytes per iteration (`models.family.
    transformer_tp_comm_bytes` counts a dense MLP in every layer), at TP `tp` > 1 with sequence parallelism (MoE's
    rule), expert-TP `etp` (None: TP), B = b s h p. Per MoE layer and micro-batch, in place of the dense MLP's 5B
    (and its row-parallel bias's all-reduce, 2hp): the router weight's gradient all-reduced (2 E h p), the
    micro-batch's gates gathered (forward) and reduce-scattered (backward) (2 T k r), its top-k indices gathered
    (8 T k), the load-balancing counts all-reduced (16 E; seq_aux_loss 16 b E); experts split over TP: the tokens
    gathered and the outputs reduce-scattered, mirrored in backward (4B); shared experts: a dense MLP's 5B (+ 2hp
    with biases). Full recomputation's first pass (without gradients: no load-balancing counts) gathers the gates
    and indices again (T k r + 8 T k), and the tokens (2B, split experts) and the shared experts' (2B), in place
    of the dense MLP's 2B. All times (t-1)/t; T = s b, the micro-batch's tokens on this rank (s/CP under context
    parallelism: each CP rank routes its own)."""
    if tp == 1 or not config.num_experts:
        return 0.0
    h, k, n, b = config.hidden_size, config.moe_router_topk, config.num_experts, micro_batch
    seq //= config.context_parallel_size
    tokens, big_b = seq * b, micro_batch * seq * h * p
    r = 8 if config.moe_router_dtype == "fp64" else 4
    split, shared = (tp if etp is None else etp) > 1, bool(config.moe_shared_expert_intermediate_size)
    balancing = config.moe_router_load_balancing_type if config.moe_aux_loss_coeff > 0 else "none"
    counts = {"aux_loss": 16 * n, "seq_aux_loss": 16 * b * n}.get(balancing, 0)
    bias = 2 * h * p if config.add_bias_linear else 0
    layer = (2 * n * h * p + 2 * tokens * k * r + 8 * tokens * k + counts + 4 * big_b * split
             + (5 * big_b + bias) * shared) - (5 * big_b + bias)
    replay = tokens * k * r + 8 * tokens * k + 2 * big_b * split + 2 * big_b * shared - 2 * big_b
    layers = range(config.num_layers) if stage is None else [i for chunk in stage.chunks for i in chunk]
    replayed = recomputed_layers(config, stage)
    total = sum(layer + replay * (i in replayed) for i in layers if config.is_moe_layer(i))
    return total * (tp - 1) / tp * micro_batches
