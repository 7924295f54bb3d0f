"""mpzero's LLaMA family with --qk-layernorm and mixture-of-experts layers <-> `transformers.Qwen3MoeForCausalLM`.

Qwen3-MoE is LLaMA (hf_llama.py) with an RMSNorm over each head's queries and keys before RoPE (`self_attn.q_norm`,
`k_norm`: mpzero's --qk-layernorm, `attention.q_layernorm`, `k_layernorm`) and sparse MoE blocks (hf_moe.py:
`mlp.gate`, `mlp.experts.e.gate_proj/up_proj/down_proj` of width `moe_intermediate_size`) in the layers that
`decoder_sparse_step` and `mlp_only_layers` name (layer i when (i + 1) % step == 0 and i is not in the list; the
others a dense SwiGLU MLP of `intermediate_size`: mpzero's --moe-layer-freq pattern and --ffn-hidden-size). Routing:
softmax over all experts and top-k, renormalised with `norm_topk_prob` (mpzero's default router), else not
(--moe-router-pre-softmax). `head_dim` (128 in the published Qwen3-MoE models, not hidden_size /
num_attention_heads) is --kv-channels, as for Llama.
"""

from __future__ import annotations

import dataclasses

from mpzero.errors import ConfigError
from mpzero.inference import hf_llama, hf_moe
from mpzero.inference.hf_values import check_value_types
from mpzero.models import GPTConfig

NAMES = hf_moe.MoENames("mlp", "gate_proj", "up_proj", "down_proj")
# transformers' Qwen3MoeConfig defaults for keys a config.json may leave out
HF_DEFAULTS = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
               "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": None, "hidden_act": "silu",
               "max_position_embeddings": 32768, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
               "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
               "use_sliding_window": False, "moe_intermediate_size": 768, "num_experts_per_tok": 8,
               "num_experts": 128, "norm_topk_prob": False}
HF_FLAGS = {**{k: v for k, v in hf_llama.HF_FLAGS.items() if k != "pretraining_tp"},
            "moe_intermediate_size": "moe_ffn_hidden_size", "num_experts": "num_experts",
            "num_experts_per_tok": "moe_router_topk", "num_local_experts": "num_experts"}


def name_pairs(config: GPTConfig) -> list[tuple[str, str, object]]:
    pairs = hf_llama.name_pairs(config, lambda layer: hf_moe.expert_pairs(config, layer, NAMES))
    for i in range(config.num_layers):
        pairs += [(f"layers.{i}.attention.{x}_layernorm.weight", f"model.layers.{i}.self_attn.{x}_norm.weight",
                   hf_llama.COPY) for x in "qk"]
    return pairs


def check_exportable(config: GPTConfig) -> None:
    """One ConfigError line for a model Qwen3MoeForCausalLM cannot compute."""
    hf_llama.check_llama_parts(config, "Qwen3MoeForCausalLM")
    hf_moe.check_routing_exportable(config, "Qwen3MoeForCausalLM")
    if not config.qk_layernorm:
        raise ConfigError("this model has no --qk-layernorm: Qwen3MoeForCausalLM normalizes queries and keys")


to_hf_state_dict, from_hf_state_dict = hf_moe.converters(name_pairs, NAMES, "Qwen3MoeForCausalLM", check_exportable)


def hf_config(config: GPTConfig, flags: dict, eod: int | None, dtype: str = "float32") -> dict:
    """config.json for `Qwen3MoeForCausalLM.from_pretrained`."""
    check_exportable(config)
    llama = hf_llama.config_json(config, flags, eod, dtype)
    dense = [i for i in range(config.num_layers) if not config.is_moe_layer(i)]
    return {**{k: v for k, v in llama.items() if k not in ("mlp_bias", "pretraining_tp")},
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "moe_intermediate_size": config.expert_ffn_size, "num_experts": config.num_experts,
            "num_experts_per_tok": config.moe_router_topk, "norm_topk_prob": not config.moe_router_pre_softmax,
            "decoder_sparse_step": 1, "mlp_only_layers": dense, "use_sliding_window": False, "sliding_window": None,
            "output_router_logits": False, "router_aux_loss_coef": float(flags.get("moe_aux_loss_coeff") or 0.0)}


def _moe_pattern(c: dict, source: str) -> int | tuple[int, ...]:
    """--moe-layer-freq of decoder_sparse_step and mlp_only_layers (1: every layer MoE)."""
    step, dense, layers = c.get("decoder_sparse_step", 1), c.get("mlp_only_layers") or [], c["num_hidden_layers"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ConfigError(f"{source}: decoder_sparse_step is {step!r}, not a positive integer")
    if not isinstance(dense, list) or any(not isinstance(i, int) or isinstance(i, bool) for i in dense):
        raise ConfigError(f"{source}: mlp_only_layers is {dense!r}, not a list of layer numbers")
    pattern = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(layers))
    return 1 if all(pattern) else pattern


def config_from_hf(hf: dict, source: str) -> GPTConfig:
    """The mpzero GPTConfig computing what this Qwen3-MoE config.json computes; one ConfigError line otherwise."""
    hf = hf_moe.with_experts_key(hf, "num_experts", "num_local_experts", source)
    c = {**HF_DEFAULTS, **{k: v for k, v in hf.items() if v is not None or k not in HF_DEFAULTS}}
    check_value_types(c, HF_DEFAULTS, source)
    if c["use_sliding_window"]:
        raise ConfigError(f"{source} has use_sliding_window true: mpzero's attention sees every earlier position")
    if c["num_experts"] == 0:
        raise ConfigError(f"{source} has num_experts 0: a dense Qwen3, not a mixture of experts mpzero imports")
    dense = hf_llama.config_from_hf({**c, "mlp_bias": c["attention_bias"]}, source)
    return hf_moe.moe_config(dataclasses.replace(dense, qk_layernorm=True), c["num_experts"],
                             c["num_experts_per_tok"], c["moe_intermediate_size"], _moe_pattern(c, source),
                             not c["norm_topk_prob"], source)


def model_flags(config: GPTConfig) -> dict:
    return {**hf_llama.model_flags(config), **hf_moe.moe_flags(config), "qk_layernorm": True}


def command_line(config: GPTConfig) -> list[str]:
    return hf_llama.command_line(config) + ["--qk-layernorm"] + hf_moe.moe_command_line(config)


def describe(config: GPTConfig) -> str:
    return (f"{config.query_groups} key/value heads with q/k RMSNorm, {config.num_experts} SwiGLU experts of width "
            f"{config.expert_ffn_size} (top-{config.moe_router_topk}, "
            f"{'not ' if config.moe_router_pre_softmax else ''}renormalised) in {len(hf_moe.moe_layers(config))} of "
            f"{config.num_layers} layers, RoPE theta {config.rotary_base:g}, RMSNorm eps {config.layernorm_epsilon:g}")
