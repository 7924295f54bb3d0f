"""Activation memory by formula: the bytes one TP rank keeps for backward, per transformer layer and per
micro-batch, for every recomputation mode. The one source of truth: the training loop prints it beside the
counted bytes (`count.py`), and a memory planner imports it.

The layer's terms are Korthikanti et al. 2022's (Eq. 1, Table 2) evaluated with e-byte activations and 1-byte
dropout masks (e = 2 gives Table 2 to the byte), plus the implementation terms mpzero adds, each derived
from what the code saves (never fitted to a count):

- reference LayerNorm (`layernorm_impl` "torch", the CPU choice) computes on `x.float()`: it keeps its input
  as a 4-byte copy (4 - e extra bytes per element), fp32 mean and rstd (4 + 4 bytes per row), and, when the
  parameters are stored in e < 4 bytes, fp32 copies of its weight and bias (4h + 4h). The Triton LayerNorm
  keeps its e-byte input (the Table 2 term), the statistics and the fp32 weight copy (4h), not the bias;
- flash attention (`--attention-backend flash` or fused: torch's scaled_dot_product_attention) keeps no [s, s]
  tensor: q, k, v as views of the QKV output (Table 2's Q, K, V items), its output, laid out [b, s, heads, d]
  so that the projection's input is a view of it (Table 2's projection input item), and an fp32 logsumexp per
  head and position (4asb/t), in place of Table 2's softmax and dropout items (what the CPU's flash kernel
  saves, counted; FlashAttention-2 on CUDA keeps the same tensors, the memory-efficient kernel pads the
  logsumexp's positions to a multiple of 32). On the CPU, attention dropout sends SDPA to its math fallback,
  which is not modeled;
- reference softmax keeps its output in fp32 (4 - e extra bytes per score) and a bool [s, s] causal mask;
  without attention dropout the value matmul keeps its own e-byte copy of the probabilities (the masked,
  cast output), where Table 2 has the dropout output. The Triton softmax keeps its e-byte output only;
- dropout on the CPU keeps its mask in the input dtype (`torch.nn.functional.dropout`'s CPU path multiplies
  by an e-byte noise tensor; CUDA's fused path keeps a bool): mask_bytes - 1 extra bytes per element;
- recomputation keeps the RNG states it replays: the default generator's and each tracker stream's
  (5056 bytes each on the CPU, 16 on CUDA);
- outside the layers (`outside_terms`, outside.py): token ids, position ids, the embedding dropout mask, the final
  LayerNorm, the logits' input, the vocabulary-padding mask, and the cross entropy's fp32 softmax, targets
  and target mask. The token ids are counted as the training loop passes them: inputs and labels are views
  of one [b, s + 1] int64 batch, kept whole by the embedding at TP 1. The chunked cross entropy
  (`cross_entropy_chunk_size` c, fused with the output projection) keeps per token the fp32 max and sum of
  exponentials (8 bytes) and the last chunk's fp32 exponentials (4 x its c' tokens x V/t, c' = sb - c
  floor((sb - 1)/c): the whole 4sbV/t when sb <= c) instead of the padding mask and the 4sbV/t softmax.

A mixture-of-experts layer has no dense MLP items: its router, dispatch, experts and shared experts' terms are
`moe.py`'s, at the rows the step routed into this rank's experts (counted) or their worst case.

Symbols: s sequence, b micro-batch, h hidden, a heads, d head size (h/a, or --kv-channels), t TP size,
e activation bytes, m dropout-mask bytes. Where ad != h, the attention's sbh-sized items (q, k, v, the projection
input, the q/k norms' tensors) are ad/h times their sbh form.
With sequence parallelism the replicated terms (LayerNorms, dropouts, the first linears' inputs) are /t.

Context parallelism (CP ranks, `mpzero.context_parallel`): s is the rank's s/CP tokens in every term. p2p and
all_gather keep what flash attention keeps (q, k, v, the output, an fp32 logsumexp); a2a runs the attention
backend on a/CP heads over CP·s tokens (the [s, s] terms become a·CP s²b/t), and keeps the output before its
all-to-all back where flash keeps it (es b ad/t). While a layer's forward attends, the ring holds two of the
stacked local K/V (KV = 2 s b g d e/t bytes: the one in use, the next in flight) and the all-gather CP + 1 (the
local one and every rank's): `exchange_term`, beside the line, not part of what is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from mpzero.activations.moe import moe_terms, worst_case_rows
from mpzero.activations.outside import embedding_terms, head_terms, kept_chunk_tokens, outside_terms
from mpzero.activations.qk_norm import qk_norm_terms, regrouped, regrouped_q_kept
from mpzero.activations.setting import (CPU_RNG_STATE_BYTES, CUDA_RNG_STATE_BYTES, ActivationSetting, Term,
                                        check_setting)
from mpzero.activations.setting import GRANULARITIES, METHODS  # noqa: F401  (re-exported)


@dataclass(frozen=True)
class LayerFormula:
    kind: str  # "stored", "selective", "checkpoint", "in chunk"
    terms: tuple[Term, ...]
    paper_text: str  # Korthikanti's expression of the paper terms (Table 2's row at e = 2 with dropout)
    host: bool = False  # kept in host memory (--offload-activations cpu): nothing on the device
    rows: int | None = None  # a mixture-of-experts layer's R: rows entering this rank's experts (moe.py)
    worst_rows: int | None = None  # its worst case (dropless, or bounded by the capacity)
    worst_bytes: int | None = None  # the layer's bytes at the worst case

    @property
    def bytes(self) -> int:
        return sum(t.bytes for t in self.terms)

    @property
    def paper_bytes(self) -> int:
        return sum(t.bytes for t in self.terms if t.paper)

    @property
    def device_bytes(self) -> int:
        return 0 if self.host else self.bytes

    @property
    def host_bytes(self) -> int | None:
        """Bytes in host memory: exact for checkpoints (each saved tensor its own storage); None for a whole
        layer, whose save_on_cpu copies views and parameters apart (not modeled)."""
        if not self.host:
            return 0
        return self.bytes if self.kind in ("checkpoint", "in chunk") else None

    def text(self) -> str:
        extras = [t for t in self.terms if not t.paper]
        parts = [f"{self.paper_text} = {self.paper_bytes:,}"] + [f"{t.name} {t.text} = {t.bytes:,}" for t in extras]
        return " + ".join(parts)


@dataclass(frozen=True)
class ActivationFormula:
    setting: ActivationSetting
    layers: tuple[LayerFormula, ...]
    outside: tuple[Term, ...]

    @property
    def worst_case_bytes(self) -> int:
        """A micro-batch's device bytes with every MoE layer at its worst case (the bound to plan with)."""
        return self.micro_batch_bytes + sum(layer.worst_bytes - layer.bytes for layer in self.layers
                                            if layer.worst_bytes is not None and not layer.host)

    @property
    def layer_bytes(self) -> list[int]:
        """Device bytes each layer keeps."""
        return [layer.device_bytes for layer in self.layers]

    @property
    def outside_bytes(self) -> int:
        return sum(t.bytes for t in self.outside)

    @property
    def micro_batch_bytes(self) -> int:
        """Device bytes one micro-batch's forward keeps for its backward."""
        return sum(self.layer_bytes) + self.outside_bytes

    @property
    def indices(self) -> tuple[int, ...]:
        """The layers' global indices (the model's activation regions)."""
        return self.setting.layer_indices

    @property
    def chunk_bytes(self) -> tuple[int, ...]:
        """Device bytes one micro-batch keeps in each model chunk of the stage: its layers, with the embedding's
        terms in the chunk that begins the model and the head's in the one that ends it."""
        setting, out, start = self.setting, [], 0
        ends = (sum(t.bytes for t in embedding_terms(setting)) if setting.first_stage else 0,
                sum(t.bytes for t in head_terms(setting)) if setting.last_stage else 0)
        chunks = setting.layer_chunks
        for c, chunk in enumerate(chunks):
            layers = sum(layer.device_bytes for layer in self.layers[start:start + len(chunk)])
            out.append(layers + (ends[0] if c == 0 else 0) + (ends[1] if c == len(chunks) - 1 else 0))
            start += len(chunk)
        return tuple(out)

    @property
    def stored_layer_bytes(self) -> int:
        """What one layer keeps without recomputation, in this setting (the ratio's denominator)."""
        return layer_formula(self.setting, "stored", self.indices[0]).bytes


def modeled(setting: ActivationSetting) -> str | None:
    """None when the formula covers this setting; else why not (one phrase)."""
    if setting.compiled_layers:
        return "torch.compile'd layers (--torch-compile) keep what the compiler chooses"
    if setting.moe_layers and (setting.moe is None or setting.moe.unmodeled):
        return (setting.moe.unmodeled if setting.moe is not None else "mixture-of-experts layers' routing, permuted "
                "tokens and experts are not modeled yet without the model's expert grid (issue 44)")
    cpu_dropout = setting.attention_dropout and setting.mask_bytes != 1
    if setting.flash_attention and cpu_dropout and "stored" in layer_kinds(setting):
        return ("scaled_dot_product_attention with attention dropout runs its math fallback on the CPU, "
                "which keeps other tensors")
    if setting.layernorm_impl not in ("torch", "triton") or setting.softmax_impl not in ("torch", "triton"):
        return "torch.compile'd fused ops keep what the compiler chooses"
    return None


def activation_formula(setting: ActivationSetting, expert_rows: dict | None = None) -> ActivationFormula:
    """Per-layer and outside-layer terms for this setting (see the module docstring). `expert_rows`: {layer: (R,
    S)}, the rows the step's routing sent into this rank's experts and the slots it sent (counted,
    `SavedBytesCounter.expert_rows`); a MoE layer without one is taken at its worst case."""
    check_setting(setting)
    if modeled(setting) is not None:
        raise ValueError(f"no activation formula: {modeled(setting)}")
    rows = expert_rows or {}
    layers = tuple(layer_formula(setting, kind, i, rows.get(i))
                   for kind, i in zip(layer_kinds(setting), setting.layer_indices))
    return ActivationFormula(setting, layers, tuple(outside_terms(setting)))


def layer_kinds(setting: ActivationSetting) -> list[str]:
    """What each layer of the stage keeps (`setting.layer_indices`' order): "stored" (everything), "selective"
    (all but the core attention), "checkpoint" (the input of a recomputed chunk), "in chunk" (nothing: a later
    layer of a uniform chunk). uniform N: layers cut into chunks of N (the last may be shorter), each chunk's input
    kept; block N: the first N layers recomputed one by one, the rest stored. Both rules apply per model chunk
    (Megatron's per-stage rule; the whole model is one chunk)."""
    g, n = setting.recompute_granularity, setting.recompute_num_layers
    kinds = []
    for chunk in setting.layer_chunks:
        if g is None or g == "selective":
            kinds += ["stored" if g is None else "selective"] * len(chunk)
        elif setting.recompute_method == "uniform":
            kinds += ["checkpoint" if i % n == 0 else "in chunk" for i in range(len(chunk))]
        else:
            kinds += ["checkpoint" if i < n else "stored" for i in range(len(chunk))]
    return kinds


def _frac_text(coef: Fraction, unit: str) -> str:
    return f"{coef.numerator}{unit}" if coef.denominator == 1 else f"{coef.numerator}/{coef.denominator}{unit}"


def _sbh_text(rep: Fraction, shard: Fraction, attn: Fraction, t: int, sp: bool) -> str:
    """Korthikanti's way of writing sbh(rep + shard/t + attn*as/(ht)), simplified for t = 1 and SP."""
    if t == 1:
        inner = [_frac_text(rep + shard, "")] if rep + shard else []
        if attn:
            inner.append(_frac_text(attn, "as/h"))
    elif sp:
        inner = [_frac_text(rep + shard, "/t")] if rep + shard else []
        if attn:
            inner.append(_frac_text(attn, "as/(ht)"))
    else:
        inner = ([_frac_text(rep, "")] if rep else []) + ([_frac_text(shard, "/t")] if shard else [])
        if attn:
            inner.append(_frac_text(attn, "as/(ht)"))
    if not inner:
        return "0"
    if len(inner) == 1 and not attn:
        return inner[0].replace("/t", "sbh/t") if inner[0].endswith("/t") else f"{inner[0]}sbh"
    return f"sbh({' + '.join(inner)})"


def layer_formula(setting: ActivationSetting, kind: str, index: int | None = None,
                  rows: tuple[int, int] | None = None) -> LayerFormula:
    """Layer `index`'s terms (a mixture-of-experts layer's at (R, S) = `rows`, None: the worst case)."""
    st = setting
    s, b, h, t = st.seq_length, st.micro_batch_size, st.hidden_size, st.tp
    e = st.dtype_bytes
    host = st.offload_activations and (kind in ("checkpoint", "in chunk") or st.recompute_granularity != "full")
    rng = (1 + st.rng_streams) * st.rng_state_bytes
    rng_term = Term("RNG states", f"{1 + st.rng_streams}x{st.rng_state_bytes}", rng)
    if kind == "in chunk":
        return LayerFormula(kind, (), "0", host)
    if kind == "checkpoint":
        div = t if (st.sequence_parallel or st.distribute_saved_activations) else 1
        text = f"{e}sbh" + ("/t" if div > 1 else "")  # Table 2's 2sbh (/t) at e = 2
        return LayerFormula(kind, (Term("checkpointed input", text, e * s * b * h // div, paper=True), rng_term),
                            text, host)
    core = kind == "stored"  # the core attention's tensors are kept (selective recomputes them)
    moe = st.moe if st.moe is not None and index in st.moe.layers else None
    paper_term = _table2_term(st, core, moe is not None)
    terms = [paper_term] + _named_terms(st, core) + ([rng_term] if kind == "selective" else [])
    if moe is None:
        return LayerFormula(kind, tuple(terms), paper_term.text, host)
    worst_bytes = sum(t.bytes for t in terms + moe_terms(st, moe, None))
    counted = rows if rows is not None else (worst_case_rows(st, moe), None)
    return LayerFormula(kind, tuple(terms + moe_terms(st, moe, rows)), paper_term.text, host, counted[0],
                        worst_case_rows(st, moe), worst_bytes)


def _table2_term(st: ActivationSetting, core: bool, moe: bool = False) -> Term:
    """Korthikanti's items: (name, coefficient of sbh bytes, replicated?) and the as^2b items (all /t), evaluated
    for the family's shapes (GPT-2's give Table 2's: Q, K, V 3e, GELU input and fc2 input 4e each; with a head
    size d other than h/a the attention's items are ad/h times theirs). A MoE layer has no dense MLP items (its
    own terms: moe.py)."""
    s, b, h, a, t, e = st.seq_length, st.micro_batch_size, st.hidden_size, st.num_attention_heads, st.tp, st.dtype_bytes
    sp, attn_drop, flash = st.sequence_parallel, st.attention_dropout, st.flash_attention
    rep_div = t if sp else 1  # replicated-region tensors: whole per rank, or a 1/t slice of the sequence
    f = Fraction(st.ffn_hidden_size or 4 * h, h)
    rep_items = [("norm inputs", 2 * e), ("QKV input", e)] + ([] if moe else [("MLP input", e)]) + (
        [("hidden dropout masks", 2)] if st.hidden_dropout else [])
    mlp_items = [] if moe else (
        [("gate and up outputs", 2 * f * e), ("SiLU output", f * e), ("down-projection input", f * e)]
        if st.swiglu else [("GELU input", f * e), ("fc2 input", f * e)])
    heads = Fraction(a * st.head_dim, h)  # q and the projection input are a d wide: h, or --kv-channels' a d
    shard_items = [("Q, K, V", _attention_inputs(st, core, flash) * e * heads), ("projection input", e * heads)] \
        + mlp_items
    attn_items = ([("softmax output", e), ("value-matmul input (dropout output)", e)]
                  + ([("attention dropout mask", 1)] if attn_drop else [])) if core and not flash else []
    rep = Fraction(sum(c for _, c in rep_items))
    shard = Fraction(sum(c for _, c in shard_items))
    attn = Fraction(sum(c for _, c in attn_items))
    if core and not flash and not attn_drop:  # Table 2 without dropout: the softmax output serves the value matmul too
        attn -= e
    sbh, as2b = s * b * h, a * s * s * b * _a2a(st)
    paper_bytes = Fraction(sbh) * rep / rep_div + Fraction(sbh) * shard / t + Fraction(as2b) * attn / t
    paper_text = _sbh_text(rep, shard, attn, t, sp)  # Table 2's row when e = 2 and dropout is on
    return Term("Table 2 items", paper_text, _exact(paper_bytes), paper=True)


def _named_terms(st: ActivationSetting, core: bool) -> list[Term]:
    """mpzero's own terms beyond Table 2: fp32 copies and statistics of the norms, the softmax's and the dropout
    masks' real dtypes, flash attention's logsumexp."""
    s, b, h, a, t, e = st.seq_length, st.micro_batch_size, st.hidden_size, st.num_attention_heads, st.tp, st.dtype_bytes
    m = st.mask_bytes if st.mask_bytes is not None else e
    rep_div = t if st.sequence_parallel else 1
    sbh, as2b = s * b * h, a * s * s * b * _a2a(st)
    attn_drop = st.attention_dropout
    terms = []
    div = "/t" if st.sequence_parallel else ""
    ln_torch = st.layernorm_impl == "torch"
    norm = "RMSNorm" if st.rms_norm else "LayerNorm"
    if ln_torch and e < 4:
        terms.append(Term(f"{norm} inputs kept in fp32", f"{2 * (4 - e)}sbh{div}", 2 * (4 - e) * sbh // rep_div))
    if ln_torch and st.rms_norm:  # the reference multiplies the weight into a kept fp32 x * rstd
        terms.append(Term("RMSNorm normalized inputs fp32", f"8sbh{div}", 8 * sbh // rep_div))
    if st.rms_norm:
        terms.append(Term("RMSNorm rstd fp32", f"8sb{div}", 8 * s * b // rep_div))
    else:
        terms.append(Term("LayerNorm mean+rstd fp32", f"16sb{div}", 16 * s * b // rep_div))
    if e < 4:
        copies = 4 if ln_torch and not st.rms_norm else 2  # weight and bias (LayerNorm reference) or weight only
        terms.append(Term(f"{norm} fp32 parameter copies", f"{4 * copies}h", 4 * copies * h))
    if core:
        terms += qk_norm_terms(st, st.flash_attention, _a2a(st))
    if core and st.flash_attention:
        terms.append(Term("flash attention logsumexp fp32", "4asb/t", 4 * a * s * b // t))
        if _a2a(st) > 1:
            terms.append(Term("attention output before its all-to-all back", f"{e}sbad/t",
                              e * s * b * a * st.head_dim // t))
    elif core:
        if st.softmax_impl == "torch":
            if e < 4:
                terms.append(Term("softmax output in fp32", f"{4 - e}as^2b/t", (4 - e) * as2b // t))
            cp = _a2a(st)
            terms.append(Term("causal mask (bool)", "s^2" if cp == 1 else f"({cp}s)^2", cp * s * cp * s))
            if not attn_drop:
                terms.append(Term("probabilities copied for the value matmul", f"{e}as^2b/t", e * as2b // t))
        if attn_drop and m != 1:
            terms.append(Term("attention dropout mask in the input dtype", f"{m - 1}as^2b/t", (m - 1) * as2b // t))
    if st.hidden_dropout and m != 1:
        terms.append(Term("hidden dropout masks in the input dtype", f"{2 * (m - 1)}sbh{div}",
                          2 * (m - 1) * sbh // rep_div))
    return terms


def _attention_inputs(st: ActivationSetting, core: bool, flash: bool) -> Fraction:
    """What the attention keeps of q, k and v, in units of e sbh/t (3 for GPT-2). r = g/a: K and V are r times
    Q's size. Selective recomputation (no `core`) keeps the QKV output (1 + 2r). The local path's matmuls keep
    contiguous copies of q, k and v at the query heads' size (K and V repeated to every head under GQA): 3.
    Flash (SDPA, enable_gqa under GQA) keeps the QKV output whole through its views, plus RoPE's rotated q (1)
    and k (r), or under GQA with several groups per rank q regrouped into a copy (1)."""
    a, t = st.num_attention_heads, st.tp
    groups = st.num_query_groups or a
    r = Fraction(groups, a)
    if not core:
        return 1 + 2 * r
    if not flash:
        return Fraction(3)
    q_copy = 1 if st.rotary or (regrouped(st, _a2a(st)) and regrouped_q_kept(st)) else 0
    return 1 + 2 * r + q_copy + (r if st.rotary else 0)


def _a2a(st: ActivationSetting) -> int:
    """CP under --cp-comm-type a2a (the attention core sees CP times the tokens, 1/CP of the heads), else 1."""
    return st.cp if st.cp > 1 and st.cp_comm_type == "a2a" else 1


def exchange_term(st: ActivationSetting) -> Term | None:
    """The stacked K/V buffers a context-parallel layer's forward holds while it attends (see the module
    docstring); None without CP, or for a2a (its all-to-alls' buffers are not modeled)."""
    if st.cp == 1 or st.cp_comm_type == "a2a":
        return None
    groups = st.num_query_groups or st.num_attention_heads
    kv = 2 * st.seq_length * st.micro_batch_size * groups * st.head_dim * st.dtype_bytes // st.tp
    held, text = (2, "2KV (in use, in flight)") if st.cp_comm_type == "p2p" else (st.cp + 1, f"{st.cp + 1}KV")
    return Term("K/V exchange buffers", f"{text}, KV = 2sbgd{st.dtype_bytes}/t", held * kv)


def _exact(value: Fraction) -> int:
    if value.denominator != 1:
        raise ValueError(f"activation bytes {value} are not whole: a shape not divisible by TP")
    return int(value)


def paper_row(setting: ActivationSetting) -> str:
    """Korthikanti Table 2's row for the setting's mode (the per-layer expression at 2-byte activations)."""
    t, sp, g = setting.tp, setting.sequence_parallel, setting.recompute_granularity
    if g == "full":
        return "2sbh/t" if (sp or setting.distribute_saved_activations) else "2sbh"
    if g == "selective":
        return "34sbh" if t == 1 else ("34sbh/t" if sp else "sbh(10 + 24/t)")
    return "sbh(34 + 5as/h)" if t == 1 else ("sbh(34/t + 5as/(ht))" if sp else "sbh(10 + 24/t + 5as/(ht))")


def mode_name(setting: ActivationSetting) -> str:
    g = setting.recompute_granularity
    mode = ("no recomputation" if g is None else "selective recomputation" if g == "selective" else
            f"full recomputation ({setting.recompute_method} {setting.recompute_num_layers})")
    if setting.distribute_saved_activations:
        mode += ", distributed checkpoints"
    if setting.sequence_parallel:
        mode += ", sequence parallel"
    if setting.offload_activations:
        mode += ", host tier"
    if setting.cp > 1:
        mode += f", CP {setting.cp} {setting.cp_comm_type}"
    return mode


__all__ = ["ActivationSetting", "ActivationFormula", "LayerFormula", "Term", "activation_formula", "exchange_term",
           "layer_formula",
           "layer_kinds", "outside_terms", "kept_chunk_tokens", "paper_row", "mode_name", "modeled",
           "check_setting", "CPU_RNG_STATE_BYTES", "CUDA_RNG_STATE_BYTES"]
