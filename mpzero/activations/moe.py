"""The activation terms of a mixture-of-experts layer (mpzero.moe) in place of the dense MLP's, per TP rank and
micro-batch, each derived from what the layer's autograd graph keeps (counted with saved-tensor hooks, never fitted):

- routing, on the T tokens the rank routes (s b, or s b/t under sequence parallelism), in the router's dtype r
  (fp32, or fp64 with --moe-router-dtype fp64): the router's input cast to r (r T h; at e = r the sequence-major
  copy of the norm's output), the weight's r-byte copy when the parameters are not in r (r E h), the top-k
  indices (8 T k), with group-limited routing the bool mask of the experts outside the best groups (T E; none
  where the expert bias makes the choice off the graph), and the gates: the softmax over the k chosen (r T k);
  with --moe-router-pre-softmax the softmax over all experts (r T E), with sigmoid scores the sigmoid's output
  (r T E) and for k > 1 the chosen scores and their sum (r T (k + 1)), their gates (r T k) kept by the weighting
  only where it weights the local ones (no sequence parallelism, no gather over EP); with the z-loss the logits
  and their logsumexp (r T E + r T); with the load-balancing loss its scores over all experts (r T E; sigmoid's
  output and its sum, r T (E + 1)) and the counts it multiplies (8 E; seq_aux_loss: per sequence, 8 b E); each
  auxiliary loss's scalar, kept to receive its gradient (r each);
- under sequence parallelism the micro-batch's gates gathered over TP (r t T k), which the weighting keeps; with
  capacity drops (--moe-expert-capacity-factor) the drop's bool mask of the micro-batch's slots (s b k) and the
  gates times it (r s b k), which the weighting keeps in place of the top-k gates;
- the dispatch of the D tokens this rank dispatches (D = t T when the experts are split over TP, else T), k slots
  each, S of them kept (D k when dropless), R rows entering this rank's experts (data-dependent, both counted by
  the dispatcher: the formula at the step's counts; the worst case R = (EP D) min(k, E_l), every slot of the
  group's tokens to this rank's E_l experts, with capacity drops at most EP E_l ceil(s b k / E x factor), and
  S = D k): alltoall keeps the slots' token index (8 S), the slot order (8 D k), the expert input (e R h), each
  row's activations (GELU input and fc2 input 2 f/etp e, gated [gate; up], SiLU output and down input 4 f/etp
  e), the expert outputs (e R h); at EP > 1 the (source rank, expert) to expert-major permutation (8 R) and the
  outputs returned by the second all-to-all (e S h); allgather keeps the chosen rows' index (8 R), the slot order
  of the EP group's EP D tokens (8 EP D k), the expert input, activations and outputs, and at EP > 1 the gathered
  gates (r EP D k); both keep the slots' outputs for the weighting, in r (r D' k h, D' the tokens weighted: D, or
  EP D for allgather); the grouped GEMM adds its offsets (4 E_l) and, with biases, each bias's row index (16 R);
- shared experts: the dense MLP's items at their width (its input e s b h, /t under sequence parallelism).

Choices no gradient flows through (the load-balancing counts, the group mask's groups, the expert bias's choice,
the capacity drop's ranking) are made on detached scores (mpzero/moe/routing.py): on the graph a top-k or scatter
whose output is dropped would keep its indices in a node backward never reaches, freed with it, and the counter
would count them.

Not modeled (the line says so): expert-TP > 1 without sequence parallelism (inference only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mpzero.activations.setting import Term


@dataclass(frozen=True)
class MoEShape:
    """What a model's MoE layers keep depends on (`moe_shape(config, ep, etp)`)."""
    layers: tuple[int, ...]  # the MoE layers' global indices
    num_experts: int  # E
    topk: int  # k
    ffn_size: int  # an expert's f
    ep: int
    etp: int
    dispatcher: str  # "alltoall" or "allgather"
    router_bytes: int  # r
    z_loss: bool
    aux_loss: bool
    shared_ffn_size: int = 0  # 0: no shared experts
    pre_softmax: bool = False  # --moe-router-pre-softmax: the softmax over all experts, then the top-k
    sigmoid: bool = False  # --moe-router-score-function sigmoid
    group_limited: bool = False  # --moe-router-group-topk: the choice masked to the best groups
    expert_bias: bool = False  # --moe-router-enable-expert-bias (sigmoid): the choice made off the graph
    seq_aux_loss: bool = False  # the load-balancing loss per sequence (its counts per sequence, [b, E])
    grouped_gemm: bool = False  # the experts in one grouped GEMM per matrix
    bias: bool = False  # the experts' biases (--add-bias-linear)
    capacity_factor: float | None = None  # --moe-expert-capacity-factor; None: dropless
    unmodeled: str | None = None  # why the terms are not modeled for this configuration
    scaled: bool = False  # --moe-router-topk-scaling-factor: the gates times it (a tensor of their own)

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep


def moe_shape(config, ep: int, etp: int, grouped_gemm: bool = False) -> MoEShape | None:
    """The config's MoE shape at EP `ep` and expert-TP `etp` (`grouped_gemm`: the experts run the grouped GEMM,
    `mpzero.moe.experts_impl`); None for a dense model."""
    layers = tuple(i for i in range(config.num_layers) if config.is_moe_layer(i))
    if not layers:
        return None
    why = ["expert-TP > 1 without sequence parallelism"] if etp > 1 and not config.sequence_parallel else []
    balancing = config.moe_router_load_balancing_type if config.moe_aux_loss_coeff > 0 else "none"
    return MoEShape(layers, config.num_experts, config.moe_router_topk, config.expert_ffn_size, ep, etp,
                    config.moe_token_dispatcher_type, 8 if config.moe_router_dtype == "fp64" else 4,
                    bool(config.moe_z_loss_coeff), balancing != "none",
                    config.moe_shared_expert_intermediate_size or 0, config.moe_router_pre_softmax,
                    config.moe_router_score_function == "sigmoid", bool(config.moe_router_group_topk),
                    config.moe_router_enable_expert_bias,
                    balancing == "seq_aux_loss",
                    grouped_gemm, config.add_bias_linear, config.moe_expert_capacity_factor,
                    ("mixture-of-experts layers with " + ", ".join(why) + " are not modeled yet (issue 44)")
                    if why else None, config.moe_router_topk_scaling_factor is not None)


def dispatched_tokens(st, moe: MoEShape) -> int:
    """D: the tokens this rank dispatches (its routed T, or the TP group's t T when experts split over TP)."""
    t_local = routed_tokens(st)
    return t_local * st.tp if st.sequence_parallel and moe.etp > 1 else t_local


def routed_tokens(st) -> int:
    """T: the tokens this rank routes."""
    return st.seq_length * st.micro_batch_size // (st.tp if st.sequence_parallel else 1)


def worst_case_rows(st, moe: MoEShape) -> int:
    """The worst case of R: every slot of the EP group's tokens that can reach this rank's experts; with capacity
    drops at most each source rank's capacity per local expert (Megatron's ceil(s b k / E x factor), the routing
    being the whole micro-batch's)."""
    rows = moe.ep * dispatched_tokens(st, moe) * min(moe.topk, moe.local_experts)
    if moe.capacity_factor is None:
        return rows
    cap = math.ceil(st.seq_length * st.micro_batch_size * moe.topk / moe.num_experts * moe.capacity_factor)
    return min(rows, moe.ep * moe.local_experts * cap)


def routing_terms(st, moe: MoEShape) -> list[Term]:
    t, e, r, h, k, n = routed_tokens(st), st.dtype_bytes, moe.router_bytes, st.hidden_size, moe.topk, moe.num_experts
    terms = [Term("router input", f"{r}Th", r * t * h)]
    if r != e:
        terms.append(Term("router weight copy", f"{r}Eh", r * n * h))
    terms.append(Term("top-k indices", "8Tk", 8 * t * k))
    if moe.group_limited and not (moe.sigmoid and moe.expert_bias):  # the masked fill keeps its bool mask
        terms.append(Term("group mask (bool)", "TE", t * n))
    if moe.sigmoid or moe.pre_softmax:  # the scores over all experts keep their output
        terms.append(Term(f"{'sigmoid' if moe.sigmoid else 'softmax'} over all experts", f"{r}TE", r * t * n))
    if moe.sigmoid and k > 1:  # normalised over the k chosen: the division keeps the chosen and their sum
        terms.append(Term("chosen scores and their sum", f"{r}T(k + 1)", r * t * (k + 1)))
    local = not (st.sequence_parallel or (moe.dispatcher == "allgather" and moe.ep > 1))
    local = local and moe.capacity_factor is None  # else the weighting keeps the kept gates (dispatch_terms)
    if local or not (moe.sigmoid or moe.pre_softmax):  # the post-top-k softmax keeps its output; other gates
        terms.append(Term("top-k gates", f"{r}Tk", r * t * k))  # are kept by the weighting, when local
    if local and moe.scaled and not (moe.sigmoid or moe.pre_softmax):  # the weighting keeps the scaled copy
        terms.append(Term("scaled top-k gates", f"{r}Tk", r * t * k))
    if moe.z_loss:
        terms.append(Term("z-loss logits and logsumexp", f"{r}T(E + 1)", r * t * (n + 1)))
    if moe.aux_loss:
        counts = ("8bE", 8 * st.micro_batch_size * n) if moe.seq_aux_loss else ("8E", 8 * n)
        scores = (f"{r}T(E + 1)", r * t * (n + 1)) if moe.sigmoid else (f"{r}TE", r * t * n)
        terms.append(Term("aux-loss scores and counts", f"{scores[0]} + {counts[0]}", scores[1] + counts[1]))
    losses = int(moe.z_loss) + int(moe.aux_loss)
    if losses:
        terms.append(Term("auxiliary loss scalars", f"{losses}x{r}", losses * r))
    return terms


def dispatch_terms(st, moe: MoEShape, rows: int, sent: int) -> list[Term]:
    """The gates, permutation, experts and weighting terms at R = `rows` entering this rank's experts and S =
    `sent` kept slots of its D tokens (D k when dropless)."""
    e, r, h, k, ep = st.dtype_bytes, moe.router_bytes, st.hidden_size, moe.topk, moe.ep
    d = dispatched_tokens(st, moe)
    c = 4 if st.swiglu else 2  # per row: [gate; up], SiLU output, down input; or GELU input, fc2 input
    gathered = moe.dispatcher == "allgather" and ep > 1
    terms, tt = [], "tT" if st.sequence_parallel else "T"  # the routing's tokens: the micro-batch's s b
    if moe.capacity_factor is not None:  # the drop's mask, kept by the gates' product with it
        terms.append(Term("kept-slot mask (bool)", f"{tt}k", st.seq_length * st.micro_batch_size * k))
    if (st.sequence_parallel or moe.capacity_factor is not None) and not gathered:
        name = "kept gates" if moe.capacity_factor is not None else "gates gathered over TP"
        terms.append(Term(name, f"{r}{tt}k", r * st.seq_length * st.micro_batch_size * k))
    if moe.dispatcher == "alltoall":
        terms += [Term("slot token index", "8S", 8 * sent), Term("slot order", "8Dk", 8 * d * k)]
        if ep > 1:
            terms += [Term("expert-major permutation", "8R", 8 * rows),
                      Term("outputs returned", f"{e}Sh", e * sent * h)]
        weighted = d
    else:
        terms += [Term("chosen rows index", "8R", 8 * rows), Term("slot order", f"8({ep}D)k", 8 * ep * d * k)]
        if gathered:
            terms.append(Term("gates gathered over EP", f"{r}({ep}D)k", r * ep * d * k))
        weighted = ep * d
    if moe.grouped_gemm:  # the offsets, and with biases each bias's row index
        terms.append(Term("grouped GEMM offsets" + (" and bias row indices" if moe.bias else ""),
                          "4E/EP" + (" + 16R" if moe.bias else ""), 4 * moe.local_experts + 16 * rows * moe.bias))
    terms += [Term("expert inputs and outputs", f"{2 * e}Rh", 2 * e * rows * h),
              Term("expert activations", f"{c * e}Rf" + ("/etp" if moe.etp > 1 else ""),
                   c * e * rows * moe.ffn_size // moe.etp),
              Term("weighted slot outputs", f"{r}{'D' if weighted == d else f'({ep}D)'}kh", r * weighted * k * h)]
    return terms


def shared_terms(st, moe: MoEShape) -> list[Term]:
    """The shared experts: a dense MLP of their width (its input skipped where it is the router's input)."""
    if not moe.shared_ffn_size:
        return []
    s, b, h, t, e = st.seq_length, st.micro_batch_size, st.hidden_size, st.tp, st.dtype_bytes
    f, rep = moe.shared_ffn_size, t if st.sequence_parallel else 1
    items = (4 if st.swiglu else 2) * f * e
    terms = [Term("shared experts' activations", f"{items}sb/t" if t > 1 else f"{items}sb", s * b * items // t)]
    if not (b == 1 and moe.router_bytes == e):  # at b = 1 the router's input is a view of the same norm output
        terms.insert(0, Term("shared experts' input", f"{e}sbh" + ("/t" if rep > 1 else ""), e * s * b * h // rep))
    return terms


def moe_terms(st, moe: MoEShape, rows: tuple[int, int] | None) -> list[Term]:
    """Every MoE term of one layer at (R, S) = `rows` (None: the worst case, R's and S = D k)."""
    if rows is None:
        rows = (worst_case_rows(st, moe), dispatched_tokens(st, moe) * moe.topk)
    return routing_terms(st, moe) + dispatch_terms(st, moe, *rows) + shared_terms(st, moe)
