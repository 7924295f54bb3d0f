"""mpzero's LLaMA family with mixture-of-experts layers <-> Hugging Face `transformers.MixtralForCausalLM`.

Mixtral is LLaMA (hf_llama.py: the attention, norms, RoPE and embeddings map as there) with every layer's MLP a
sparse MoE block: a router `block_sparse_moe.gate` and `num_local_experts` SwiGLU experts w1 (gate), w3 (up) and
w2 (down) of width `intermediate_size`, each token sent to `num_experts_per_tok` of them by softmax, top-k,
renormalised (hf_moe.py: mpzero's default softmax router). mpzero's model: --num-experts, --moe-router-topk,
--moe-ffn-hidden-size (and --ffn-hidden-size) = intermediate_size, --moe-layer-freq 1. Training-only choices of
config.json (router_aux_loss_coef with output_router_logits, router_jitter_noise) do not change the logits and
are not imported (pass --moe-aux-loss-coeff to train: Megatron's per-layer loss, not HF's pooled one).
"""

from __future__ import annotations

from mpzero.errors import ConfigError
from mpzero.inference import hf_llama, hf_moe
from mpzero.inference.hf_values import check_value_types
from mpzero.models import GPTConfig

NAMES = hf_moe.MoENames("block_sparse_moe", "w1", "w3", "w2")
# transformers' MixtralConfig defaults for keys a config.json may leave out (RoPE theta 1e6: its default_theta)
HF_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "hidden_act": "silu",
               "max_position_embeddings": 4096 * 32, "initializer_range": 0.02, "rms_norm_eps": 1e-5,
               "tie_word_embeddings": False, "attention_dropout": 0.0, "num_local_experts": 8,
               "num_experts_per_tok": 2}
HF_FLAGS = {**{k: v for k, v in hf_llama.HF_FLAGS.items() if k != "pretraining_tp"},
            "intermediate_size": "moe_ffn_hidden_size", "num_local_experts": "num_experts",
            "num_experts_per_tok": "moe_router_topk", "num_experts": "num_experts"}
DEFAULT_THETA = 1e6


def name_pairs(config: GPTConfig) -> list[tuple[str, str, object]]:
    return hf_llama.name_pairs(config, lambda layer: hf_moe.expert_pairs(config, layer, NAMES))


def check_exportable(config: GPTConfig) -> None:
    """One ConfigError line for a model MixtralForCausalLM cannot compute."""
    hf_llama.check_llama_parts(config, "MixtralForCausalLM")
    hf_moe.check_routing_exportable(config, "MixtralForCausalLM")
    unsupported = [(config.qk_layernorm, "--qk-layernorm (a Qwen3-MoE's)"),
                   (hf_moe.moe_layers(config) != list(range(config.num_layers)),
                    "dense layers (--moe-layer-freq; Mixtral: every layer MoE)"),
                   (config.moe_router_pre_softmax, "--moe-router-pre-softmax (Mixtral renormalises the top-k)")]
    for bad, what in unsupported:
        if bad:
            raise ConfigError(f"this model has {what}: MixtralForCausalLM cannot compute it")


to_hf_state_dict, from_hf_state_dict = hf_moe.converters(name_pairs, NAMES, "MixtralForCausalLM", check_exportable)


def hf_config(config: GPTConfig, flags: dict, eod: int | None, dtype: str = "float32") -> dict:
    """config.json for `MixtralForCausalLM.from_pretrained`."""
    check_exportable(config)
    llama = hf_llama.config_json(config, flags, eod, dtype)
    dropped = ("attention_bias", "mlp_bias", "pretraining_tp")
    return {**{k: v for k, v in llama.items() if k not in dropped}, "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral", "intermediate_size": config.expert_ffn_size,
            "num_local_experts": config.num_experts, "num_experts_per_tok": config.moe_router_topk,
            "output_router_logits": False, "router_aux_loss_coef": float(flags.get("moe_aux_loss_coeff") or 0.0),
            "router_jitter_noise": 0.0, "sliding_window": None}


def config_from_hf(hf: dict, source: str) -> GPTConfig:
    """The mpzero GPTConfig computing what this Mixtral config.json computes; one ConfigError line otherwise."""
    hf = hf_moe.with_experts_key(hf, "num_local_experts", "num_experts", source)
    c = {**HF_DEFAULTS, **{k: v for k, v in hf.items() if v is not None or k not in HF_DEFAULTS}}
    check_value_types(c, HF_DEFAULTS, source)
    window = c.get("sliding_window")
    if window is not None and (not isinstance(window, int) or window < c["max_position_embeddings"]):
        raise ConfigError(f"{source} has sliding_window {window!r}: mpzero's attention sees every earlier position")
    if (c.get("rope_parameters") or {}).get("rope_theta") is None and c.get("rope_theta") is None:
        c["rope_theta"] = DEFAULT_THETA
    return hf_moe.moe_config(hf_llama.config_from_hf({**c, "attention_bias": False, "mlp_bias": False}, source),
                      c["num_local_experts"], c["num_experts_per_tok"], c["intermediate_size"], 1, False, source)


def model_flags(config: GPTConfig) -> dict:
    return {**hf_llama.model_flags(config), **hf_moe.moe_flags(config)}


def command_line(config: GPTConfig) -> list[str]:
    return hf_llama.command_line(config) + hf_moe.moe_command_line(config)


def describe(config: GPTConfig) -> str:
    return (f"{config.query_groups} key/value heads, {config.num_experts} SwiGLU experts of width "
            f"{config.expert_ffn_size} (top-{config.moe_router_topk}, renormalised), RoPE theta "
            f"{config.rotary_base:g}, RMSNorm eps {config.layernorm_epsilon:g}")
