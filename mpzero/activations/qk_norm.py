"""What --qk-layernorm's q and k norms keep in a layer whose core attention is stored (not recomputed), with the
torch reference RMSNorm (`mpzero.fused.rms_norm_reference`: the fp32 input, x * rstd and rstd saved; on CPU, and
wherever --no-layernorm-fusion or a missing kernel picks it). Units: e sbh/t is one q's bytes (e sbad/t with
--kv-channels d), r = g/a.

- the normalized q and k in fp32, 4(1 + r) sbh/t, and their rstd, 4sb(a + g)/t;
- below fp32 (e < 4): the fp32 copies of the inputs, 4(1 + r) sbh/t, and of the two [d] weights, 8d;
- in fp32 the norms keep their inputs themselves: views of the QKV output, which the local path's matmuls (with
  their own contiguous copies) would otherwise free, (1 + 2r) e sbh/t, and under GQA with several groups per rank
  q's regrouped copy, e sbh/t (flash without RoPE already counts that copy: the formula's q_copy);
- flash without RoPE: SDPA keeps the norms' outputs, (1 + r) e sbh/t (with RoPE it keeps the rotated ones instead,
  counted already), and below fp32 q's regrouped copy is freed (`regrouped_q_kept` says whether it stays).
Counted equal on the CPU (tests/test_qk_norm.py). The triton RMSNorm's saved tensors (a contiguous input copy and
rstd, on GPUs) are not modeled yet: no terms then, the run's activation line shows the difference.
"""

from __future__ import annotations

from fractions import Fraction

from mpzero.activations.setting import ActivationSetting, Term


def regrouped(st: ActivationSetting, a2a: int) -> bool:
    """q regrouped into a copy: GQA with several key/value groups per rank."""
    groups = st.num_query_groups or st.num_attention_heads
    return groups != st.num_attention_heads and groups // (st.tp * a2a) > 1


def regrouped_q_kept(st: ActivationSetting) -> bool:
    """Whether q's regrouped copy outlives the forward without RoPE (the norm keeps it in fp32 only)."""
    return not (st.qk_layernorm and st.layernorm_impl == "torch" and st.dtype_bytes < 4)


def qk_norm_terms(st: ActivationSetting, flash: bool, a2a: int) -> list[Term]:
    if not st.qk_layernorm or st.layernorm_impl != "torch":
        return []
    s, b, a, t, e = st.seq_length, st.micro_batch_size, st.num_attention_heads, st.tp, st.dtype_bytes
    groups = st.num_query_groups or a
    r = Fraction(groups, a)
    unit = Fraction(s * b * a * st.head_dim, t)  # one q's elements on this rank (sbh/t unless --kv-channels)

    def term(name: str, text: str, value: Fraction) -> Term:
        return Term(name, text, int(value))
    terms = [term("q/k norms normalized fp32", f"4(1+{r})sbh/t", 4 * (1 + r) * unit),
             term("q/k norms rstd fp32", "4sb(a+g)/t", Fraction(4 * s * b * (a + groups), t))]
    if e < 4:
        terms += [term("q/k norm inputs kept in fp32", f"4(1+{r})sbh/t", 4 * (1 + r) * unit),
                  term("q/k norm fp32 weight copies", "8d", Fraction(8 * st.head_dim))]
    else:
        if not flash:
            terms.append(term("QKV output kept by the norms' inputs", f"{e}(1+2*{r})sbh/t", e * (1 + 2 * r) * unit))
        if regrouped(st, a2a) and (st.rotary or not flash):
            terms.append(term("q's regrouped copy kept by its norm", f"{e}sbh/t", e * unit))
    if flash and not st.rotary:
        terms.append(term("q/k norm outputs kept by SDPA", f"{e}(1+{r})sbh/t", e * (1 + r) * unit))
    return terms
