"""The bytes a context-parallel rank sends per training iteration on its CP group, by formula (`cp_comm_theory`),
printed beside what `CommGroup` counted (`cp_comm_line`), and used by the planner and the dry run.

Per layer and micro-batch, for the local s/CP tokens of b sequences, t the TP size, e the activations' bytes:
  KV = 2 b (s/CP) (g/t) d e   the local keys and values (g key/value heads of size d)
  p2p        forward (CP-1) KV (the ring's sends);  backward (CP-1) KV again + CP dK/dV sums in fp32 (4/e KV each)
  all_gather forward (CP-1) KV (CommGroup's all-gather count: (CP-1)/CP of the gathered CP KV);  backward (CP-1) KV
             again + (CP-1) 4/e KV (the fp32 dK/dV reduce-scattered)
  a2a        forward (CP-1)/CP of the QKV output (b (s/CP) (a + 2g)/t d e) and of the attention output
             (b (s/CP) (a/t) d e); backward the same for their gradients
A layer whose forward runs again in backward (full recomputation, or selective: the core attention) exchanges its
forward's bytes again. Evaluation's forwards are not a training iteration's and are not counted. A pipeline rank
(`stage`, a `ModelStage`) counts its own layers L, recomputation's rules per model chunk (block: the first N of each).
A mixture-of-experts layer with a load-balancing loss also sums the loss's token counts over CP (int64, E of them;
per sequence with seq_aux_loss: b E) once per micro-batch (in the forward that records them: under full
recomputation the replay), an all-reduce: 2 (CP-1)/CP of their bytes.
"""

from __future__ import annotations


def _per_layer(config, tp: int, micro_batch: int, seq: int, p: int) -> tuple[float, float, str, str]:
    """(forward bytes, backward bytes, forward text, backward text) of one layer and micro-batch."""
    cp, comm = config.context_parallel_size, config.cp_comm_type
    d, local = config.head_dim, seq // cp
    kv = 2 * micro_batch * local * (config.query_groups // tp) * d * p
    wide = kv * 4 // p  # dK/dV summed in fp32
    if comm == "p2p":
        return (cp - 1) * kv, (cp - 1) * kv + cp * wide, "(CP-1)KV", f"(CP-1)KV+CP(4/{p})KV"
    if comm == "all_gather":
        return (cp - 1) * kv, (cp - 1) * (kv + wide), "(CP-1)KV", f"(CP-1)(1+4/{p})KV"
    qkv = micro_batch * local * (config.num_attention_heads + 2 * config.query_groups) // tp * d * p
    out = micro_batch * local * config.num_attention_heads // tp * d * p
    moved = (qkv + out) * (cp - 1) / cp
    return moved, moved, "(CP-1)/CP(QKV+O)", "(CP-1)/CP(QKV+O)"


def recomputed_forwards(config, chunks: list[int]) -> int:
    """Layers of model chunks of `chunks` layers whose forward (with its CP exchange) runs again in backward."""
    if config.granularity == "selective":
        return sum(chunks)
    if config.granularity == "full":
        n, uniform = config.resolved_recompute_num_layers, config.resolved_recompute_method == "uniform"
        return sum(chunks) if uniform else sum(min(n, chunk) for chunk in chunks)
    return 0


def cp_comm_theory(config, tp: int, micro_batch: int, seq: int, p: int, micro_batches: int,
                   stage=None) -> tuple[float, str]:
    """(bytes per rank per iteration, formula) on the CP group of the transformer `config` (its
    context_parallel_size, cp_comm_type and recomputation) at TP `tp`, `seq` the whole sequence, p the
    activations' bytes, for the pipeline rank holding `stage` (None: the whole model); 0 at CP 1."""
    if config.context_parallel_size == 1:
        return 0.0, "0"
    forward, backward, ftext, btext = _per_layer(config, tp, micro_batch, seq, p)
    chunks = [config.num_layers] if stage is None else [len(chunk) for chunk in stage.chunks]
    layers, again = sum(chunks), recomputed_forwards(config, chunks)
    total = micro_batches * ((layers + again) * forward + layers * backward)
    text = f"m(({layers}+{again}){ftext}+{layers}({btext}))" if again else f"mL({ftext}+{btext})"
    moe_layers, counts, counts_text = _moe_counts(config, micro_batch, stage)
    if moe_layers:
        cp = config.context_parallel_size
        total += micro_batches * moe_layers * 2 * (cp - 1) * counts / cp
        text += f"+m{moe_layers}(2(CP-1)/CP){counts_text}"
    return total, text


def _moe_counts(config, micro_batch: int, stage) -> tuple[int, int, str]:
    """(MoE layers with a load-balancing loss on the rank's stage, bytes of one layer's counts, their formula)."""
    if (not getattr(config, "num_experts", None) or config.moe_router_load_balancing_type == "none"
            or not config.moe_aux_loss_coeff):
        return 0, 0, ""
    layers = range(config.num_layers) if stage is None else [i for chunk in stage.chunks for i in chunk]
    moe_layers = sum(1 for i in layers if config.is_moe_layer(i))
    if config.moe_router_load_balancing_type == "seq_aux_loss":
        return moe_layers, 8 * micro_batch * config.num_experts, "8bE"
    return moe_layers, 8 * config.num_experts, "8E"


def cp_comm_line(config, tp: int, micro_batch: int, seq: int, p: int, micro_batches: int, measured: float,
                 stage=None) -> str:
    """The `cp comm` line: bytes this rank (holding `stage`) sent on its CP group in an iteration, against
    `cp_comm_theory`."""
    theory, text = cp_comm_theory(config, tp, micro_batch, seq, p, micro_batches, stage)
    ratio = measured / theory if theory else float("nan")
    return (f"cp comm | {config.cp_comm_type} | cp {config.context_parallel_size} | micro-batches {micro_batches} | "
            f"measured bytes/iter {measured:.0f} | theory {text} | theory bytes/iter {theory:.0f} | "
            f"ratio {ratio:.4f}")
