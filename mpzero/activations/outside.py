"""What a micro-batch keeps outside the transformer layers (embedding, final LayerNorm, logits, loss):
`outside_terms`, each term derived in formula.py's module docstring, and `kept_chunk_tokens`, the tokens of the
chunked cross entropy's last chunk (its exponentials are kept for backward).
"""

from __future__ import annotations

from mpzero.activations.setting import ActivationSetting, Term


def outside_terms(setting: ActivationSetting) -> list[Term]:
    """What a micro-batch keeps outside the transformer layers: the embedding's terms on the stage that begins the
    model, the head's and the loss's on the one that ends it (a middle stage receives hidden states that its
    first layer keeps: nothing outside its layers)."""
    return ((embedding_terms(setting) if setting.first_stage else [])
            + (head_terms(setting) if setting.last_stage else []))


def embedding_terms(setting: ActivationSetting) -> list[Term]:
    """Token ids (inputs and labels are views of one [b, s + 1] int64 batch, kept whole by the embedding at TP 1),
    position ids, the embedding's dropout mask."""
    st = setting
    s, b, h, t, e = st.seq_length, st.micro_batch_size, st.hidden_size, st.tp, st.dtype_bytes
    m = st.mask_bytes if st.mask_bytes is not None else e
    rep_div, div = (t, "/t") if st.sequence_parallel else (1, "")
    terms = []
    if t == 1 and st.cp > 1:  # the rank's inputs: its own [b, s] tensor (`mpzero.context_parallel.split_batch`)
        terms.append(Term("token ids (this CP rank's [b, s] int64 inputs)", "8sb", 8 * s * b))
    elif t == 1:
        terms.append(Term("token ids (the [b, s+1] int64 batch)", "8b(s+1)", 8 * b * (s + 1)))
    else:
        terms += [Term("shard-local token ids (int64)", "8sb", 8 * s * b),
                  Term("ids outside the vocabulary shard (bool)", "sb", s * b)]
    if st.learned_positions:
        terms.append(Term("position ids (int64)", "8s", 8 * s))
    if st.hidden_dropout:
        terms.append(Term("embedding dropout mask", f"{m}sbh{div}", m * s * b * h // rep_div))
    return terms


def head_terms(setting: ActivationSetting) -> list[Term]:
    """The final norm, the logits' input, the cross entropy (its labels, views of the loaded batch, are not kept:
    it keeps its own shard-local targets)."""
    st = setting
    s, b, h, t, e = st.seq_length, st.micro_batch_size, st.hidden_size, st.tp, st.dtype_bytes
    rep_div, div = (t, "/t") if st.sequence_parallel else (1, "")
    local_vocab = st.padded_vocab_size // t
    terms = []
    ln_torch = st.layernorm_impl == "torch"
    ln_in = 4 if ln_torch else e
    norm = "RMSNorm" if st.rms_norm else "LayerNorm"
    terms.append(Term(f"final {norm} input", f"{ln_in}sbh{div}", ln_in * s * b * h // rep_div))
    if st.rms_norm and ln_torch:
        terms.append(Term("final RMSNorm normalized input fp32", f"4sbh{div}", 4 * s * b * h // rep_div))
    stats = 4 if st.rms_norm else 8
    terms.append(Term(f"final {norm} {'rstd' if st.rms_norm else 'mean+rstd'} fp32", f"{stats}sb{div}",
                      stats * s * b // rep_div))
    if e < 4:
        copies = 2 if ln_torch and not st.rms_norm else 1
        terms.append(Term(f"final {norm} fp32 parameter copies", f"{4 * copies}h", 4 * copies * h))
    terms.append(Term("logits input", f"{e}sbh{div}", e * s * b * h // rep_div))
    if st.cross_entropy_chunk_size:
        terms.append(Term("cross-entropy max and sum of exponentials fp32", "8sb", 8 * s * b))
        kept = kept_chunk_tokens(s * b, st.cross_entropy_chunk_size)
        terms.append(Term("cross-entropy last chunk's exponentials fp32",
                          "4sbV/t" if kept == s * b else f"{4 * kept}V/t", 4 * kept * local_vocab))
    else:
        first_padding = st.vocab_size - st.tp_rank * local_vocab
        if first_padding < local_vocab:
            terms.append(Term("vocabulary padding mask (bool)", "V/t", local_vocab))
        terms.append(Term("cross-entropy softmax fp32", "4sbV/t", 4 * s * b * local_vocab))
    terms.append(Term("cross-entropy targets (int64) and mask (bool)", "9sb", 9 * s * b))
    return terms


def kept_chunk_tokens(tokens: int, chunk_size: int) -> int:
    """The tokens of the chunked cross entropy's last chunk (`_LinearCrossEntropy`), whose exponentials forward
    keeps for backward; the others are recomputed there."""
    return tokens - chunk_size * ((tokens - 1) // chunk_size)
