"""What zero bubble's split backward keeps between a micro-batch's I pass and its W pass (Qi et al.'s memory of W,
"32sbh" per layer at 2-byte activations): every other tensor the forward saved is freed when I ends, and the
`WeightGradStore` (mpzero/tensor_parallel/weight_grad.py) holds, for each tensor-parallel linear of a transformer
layer, its input and its output's gradient, from which W computes the weight gradient. Per layer, e-byte tensors
(sequence parallel: the column-parallel linears keep their input as this rank's 1/t slice, gathered again in W):

  QKV         input sbh (/t),  output gradient sb(a + 2g)d/t     (g K/V groups of a heads of size d; 3sbh/t
                                                                   without GQA and --kv-channels)
  projection  input sbad/t,    output gradient sbh               (the row-parallel product is whole before its
                                                                   all-reduce or reduce-scatter)
  fc1         input sbh (/t),  output gradient sbf/t             (SwiGLU's [gate; up]: 2sbf/t)
  fc2         input sbf/t,     output gradient sbh

GPT-2 at TP 1 (f = 4h): 16 e sbh, the paper's 32sbh at e = 2. The output layer's weight gradient is not deferred.
"""

from __future__ import annotations

from mpzero.activations.setting import ActivationSetting, Term


def deferred_layer_terms(setting: ActivationSetting) -> tuple[Term, ...]:
    """The bytes one transformer layer's deferred weight gradients hold for one micro-batch (module docstring)."""
    st = setting
    s, b, h, a, t, e = st.seq_length, st.micro_batch_size, st.hidden_size, st.num_attention_heads, st.tp, st.dtype_bytes
    f, g = st.ffn_hidden_size or 4 * h, st.num_query_groups or a
    sb = s * b
    rep_div, div = (t, "/t") if st.sequence_parallel else (1, "")
    d = st.head_dim
    qkv = (a + 2 * g) * d
    fc1 = 2 * f if st.swiglu else f
    return (Term("QKV input", f"{e}sbh{div}", e * sb * h // rep_div),
            Term("QKV output gradient", f"{e}sb(a+2g)d/t", e * sb * qkv // t),
            Term("projection input", f"{e}sbad/t", e * sb * a * d // t),
            Term("projection output gradient", f"{e}sbh", e * sb * h),
            Term("fc1 input", f"{e}sbh{div}", e * sb * h // rep_div),
            Term("fc1 output gradient", f"{e}sb{'2' if st.swiglu else ''}f/t", e * sb * fc1 // t),
            Term("fc2 input", f"{e}sbf/t", e * sb * f // t),
            Term("fc2 output gradient", f"{e}sbh", e * sb * h))


def deferred_bytes(setting: ActivationSetting) -> int:
    """What the store holds for one micro-batch of the setting's stage: every layer's deferred terms."""
    return len(setting.layer_indices) * sum(term.bytes for term in deferred_layer_terms(setting))
