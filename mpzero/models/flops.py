"""Matmul FLOPs per trained token of the transformer a `GPTConfig` describes (`GPTConfig.flops_per_token`), as
Megatron counts them (megatron/training/training.py, num_floating_point_operations).

For GPT: 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) per batch of B sequences of s tokens, V the padded vocabulary at
this TP size. Per token and layer a forward is 24 h^2 (QKV 6h^2, projection 2h^2, MLP 16h^2) + 4 s h (scores and
the weighted sum of values, over all s positions: the causal half is not subtracted); the logits add 2 h V;
backward is twice the forward. Full recomputation (`recompute_activations`) runs the layers' forward once more, not
the logits': 96 l h^2 (1 + s/(6h)) + 6 h V (Narayanan et al. 2021's 96 B s l h^2 (1 + s/(6h) + V/(16 l h));
Megatron's own printed figure leaves recomputation out); with --recompute-method block N only the first N layers
are recomputed. Selective recomputation runs the core attention's two matmuls once more: + 4 l s h per token (what
FlopCounterMode counts; Korthikanti et al.'s Appendix A writes selective's hardware FLOPs as
72 B s l h^2 (1 + s/(3h) + V/(12 l h)), + 12 l s h). The chunked cross entropy (`cross_entropy_chunk_size` c)
recomputes in backward the logits of every chunk but the last of a micro-batch of `micro_batch_size` b sequences:
+ 2 h V (sb - c')/(sb), c' the last chunk's tokens (`kept_chunk_tokens`); none when sb <= c (s: a
context-parallel rank's s/CP tokens).

The LLaMA family's terms: QKV 2h(h + 2gd) for g query groups of head size d (K and V smaller), and the MLP 2hf per
matrix, three of them with SwiGLU (gate, up, down), for ffn width f. A head size other than h/a (--kv-channels d):
every h that stands for the heads' total width is a d (Megatron's kv_channels terms): QKV 2h(a + 2g)d, the
projection 2adh, the core attention 4sad (its selective recomputation too).

A mixture-of-experts layer (`num_experts`, on the layers `moe_layer_freq` names) counts its active parameters
(Megatron's MoE terms): the router 2hE, the k experts each token is routed to, 2 h f_e per matrix each (f_e:
--moe-ffn-hidden-size), and the shared experts' MLP of width f_s (--moe-shared-expert-intermediate-size); dropped
tokens (a capacity factor) are not subtracted.
"""

from __future__ import annotations

from mpzero.activations import kept_chunk_tokens


def mlp_flops(config, layer: int) -> int:
    """Forward matmul FLOPs per token of layer `layer`'s MLP (dense, or the mixture of experts' active part)."""
    h, matrices = config.hidden_size, 3 if config.swiglu else 2
    if not config.is_moe_layer(layer):
        return 2 * h * config.ffn_size * matrices
    shared = 2 * h * (config.moe_shared_expert_intermediate_size or 0) * matrices
    return 2 * h * config.num_experts + config.moe_router_topk * 2 * h * config.expert_ffn_size * matrices + shared


def flops_per_token(config, tp_size: int = 1, micro_batch_size: int = 1) -> float:
    """Forward and backward matmul FLOPs per trained token (the module docstring)."""
    l, h, s = config.num_layers, config.hidden_size, config.seq_length or config.max_position_embeddings
    vocab = config.padded_vocab_size(tp_size)
    # QKV 2h(a + 2g)d (6h^2 without GQA), projection 2adh, attention 4sad (ad = h unless --kv-channels); RoPE,
    # norms and activations are not matmuls
    width = config.attention_width
    qkv = 2 * h * (config.num_attention_heads + 2 * config.query_groups) * config.head_dim
    layers = [qkv + 2 * width * h + 4 * s * width + mlp_flops(config, i) for i in range(l)]
    recomputed = 0
    if config.granularity == "full":
        n = config.resolved_recompute_num_layers
        recomputed = sum(layers if config.resolved_recompute_method == "uniform" else layers[:n])
    elif config.granularity == "selective":
        recomputed = l * 4 * s * width
    logits = 3 * 2 * h * vocab
    if config.cross_entropy_chunk_size:
        tokens = s // config.context_parallel_size * micro_batch_size  # a CP rank's loss: its s/CP tokens
        logits += 2 * h * vocab * (tokens - kept_chunk_tokens(tokens, config.cross_entropy_chunk_size)) / tokens
    return 3 * sum(layers) + recomputed + logits
