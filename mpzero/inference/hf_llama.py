"""mpzero's LLaMA-family GPT <-> Hugging Face `transformers.LlamaForCausalLM`: weights, config.json, what cannot map.

The two compute the same function; only the storage differs:
- mpzero's fused QKV rows are laid out group by group, each K/V group its query heads then its key and value head
  ([g, (heads/g + 2), d] rows: a contiguous TP split hands each rank whole groups); HF stores q_proj [a d, h],
  k_proj and v_proj [g d, h].
- mpzero's fused [gate; up] fc1 is HF's gate_proj then up_proj; fc2 is down_proj. nn.Linear on both sides: no
  transposes.
- RoPE: both rotate halves (HF's rotate_half; mpzero.models.rotary), so no q/k permutation either way (the Meta
  -> HF permutation is for Meta's interleaved checkpoints, which this does not read).
- Tied output weights are not stored by HF (`lm_head.weight` is `model.embed_tokens.weight`); untied ones are.
- HF's RMSNorm casts the normalized input to the activations' dtype before the weight, mpzero's after: the same
  in fp32, one rounding apart in bf16.
Vocabulary padding never reaches HF: checkpoints store the real rows only. Nothing here imports transformers.
"""

from __future__ import annotations

import re

import torch

from mpzero.errors import ConfigError
from mpzero.inference import hf_gpt2
from mpzero.inference.hf_values import check_value_types
from mpzero.inference.weights import expected_shapes
from mpzero.models import GPTConfig

COPY, Q, K, V, GATE, UP = "copy", "q", "k", "v", "gate", "up"
# HF's defaults (transformers LlamaConfig) for keys a config.json may leave out
HF_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu",
               "max_position_embeddings": 2048, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
               "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
               "pretraining_tp": 1}
# each numeric key's pretrain_gpt.py flag (its range: mpzero/cli/flag_ranges.py); head_dim is --kv-channels (Megatron's
# projection size per head), pretraining_tp must be 1 (config_from_hf), rope_theta becomes --rotary-base (_rope_theta)
HF_FLAGS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "ffn_hidden_size",
            "num_hidden_layers": "num_layers", "num_attention_heads": "num_attention_heads",
            "num_key_value_heads": "num_query_groups", "head_dim": "kv_channels",
            "max_position_embeddings": "max_position_embeddings", "initializer_range": "init_method_std",
            "rms_norm_eps": "layernorm_epsilon", "attention_dropout": "attention_dropout",
            "pretraining_tp": "tensor_model_parallel_size", "rope_theta": "rotary_base"}
OLD_BUFFERS = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")  # older releases saved it


def name_pairs(config: GPTConfig, moe_pairs=None) -> list[tuple[str, str, str]]:
    """(mpzero name, HF name, conversion) for every HF tensor; one fused mpzero tensor gives several HF ones.
    `moe_pairs(layer)`: a mixture-of-experts layer's MLP pairs (hf_moe.py), in place of the dense MLP's."""
    pairs = [("embedding.word_embeddings.weight", "model.embed_tokens.weight", COPY)]
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        pairs += [(ours + "input_layernorm.weight", theirs + "input_layernorm.weight", COPY),
                  (ours + "post_attention_layernorm.weight", theirs + "post_attention_layernorm.weight", COPY)]
        kinds = ("weight", "bias") if config.add_bias_linear else ("weight",)
        for kind in kinds:
            pairs += [(f"{ours}attention.qkv.{kind}", f"{theirs}self_attn.{p}_proj.{kind}", which)
                      for p, which in (("q", Q), ("k", K), ("v", V))]
            pairs.append((f"{ours}attention.dense.{kind}", f"{theirs}self_attn.o_proj.{kind}", COPY))
            if not config.is_moe_layer(i):
                pairs += [(f"{ours}mlp.fc1.{kind}", f"{theirs}mlp.gate_proj.{kind}", GATE),
                          (f"{ours}mlp.fc1.{kind}", f"{theirs}mlp.up_proj.{kind}", UP),
                          (f"{ours}mlp.fc2.{kind}", f"{theirs}mlp.down_proj.{kind}", COPY)]
        if config.is_moe_layer(i):
            pairs += moe_pairs(i)
    pairs.append(("final_layernorm.weight", "model.norm.weight", COPY))
    if config.untie_embeddings_and_output_weights:
        pairs.append(("output_layer.weight", "lm_head.weight", COPY))
    return pairs


def _qkv_groups(t: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """QKV rows (or bias) as [groups, heads/groups + 2, d, ...]."""
    g = config.query_groups
    return t.reshape(g, config.num_attention_heads // g + 2, config.head_dim, *t.shape[1:])


def part(t: torch.Tensor, kind: str, config: GPTConfig) -> torch.Tensor:
    """The HF tensor `kind` cut out of mpzero's fused tensor `t`."""
    if kind in (GATE, UP):
        return t.chunk(2, dim=0)[0 if kind == GATE else 1]
    if kind in (Q, K, V):
        groups, per = _qkv_groups(t, config), config.num_attention_heads // config.query_groups
        part = groups[:, :per] if kind == Q else groups[:, per if kind == K else per + 1]
        return part.reshape(-1, *t.shape[1:])
    return t


def to_hf_state_dict(weights: dict[str, torch.Tensor], config: GPTConfig,
                     dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """HF LlamaForCausalLM's state dict (as `save_pretrained` stores it) from mpzero's full weights by name."""
    check_exportable(config)
    return {theirs: part(weights[ours], kind, config).to(dtype).contiguous().clone()
            for ours, theirs, kind in name_pairs(config)}


def fuse(parts: dict[str, torch.Tensor], config: GPTConfig) -> torch.Tensor:
    """mpzero's fused tensor from its HF parts (q, k, v or gate, up)."""
    if GATE in parts:
        return torch.cat([parts[GATE], parts[UP]], dim=0)
    g, per, d = config.query_groups, config.num_attention_heads // config.query_groups, config.head_dim
    rest = parts[Q].shape[1:]
    q = parts[Q].reshape(g, per, d, *rest)
    k, v = (parts[x].reshape(g, 1, d, *rest) for x in (K, V))
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _fuse_or_copy(parts: dict, config: GPTConfig) -> torch.Tensor:
    return parts[COPY] if COPY in parts else fuse(parts, config)


def from_hf_state_dict(state: dict[str, torch.Tensor], config: GPTConfig, source: str, pairs=None,
                       hf_class: str = "LlamaForCausalLM", fuse_parts=_fuse_or_copy) -> dict[str, torch.Tensor]:
    """mpzero's full fp32 weights by name from an HF Llama state dict (or, with their `pairs` and
    `fuse_parts(parts, config)`, another LLaMA-like class's: hf_moe.py); a missing, unexpected or misshapen tensor
    is one ConfigError line."""
    pairs = pairs or name_pairs(config)
    family = "Llama" if hf_class == "LlamaForCausalLM" else hf_class
    state = hf_gpt2.known_tensors(state, config, pairs, OLD_BUFFERS, source, family, hf_class)
    grouped: dict[str, dict] = {}
    for ours, theirs, kind in pairs:
        if theirs not in state:
            raise ConfigError(f"{source} has no {theirs}: not a complete {hf_class} of its config.json")
        grouped.setdefault(ours, {})[kind] = state[theirs].float()
    shapes, weights = expected_shapes(config), {}
    for ours, parts in grouped.items():
        try:
            full = fuse_parts(parts, config)
        except RuntimeError:  # a part of another size than its config.json says
            full = None
        if full is None or tuple(full.shape) != shapes[ours]:
            names = [theirs for o, theirs, _ in pairs if o == ours]
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise ConfigError(f"{source}: {shown} do not have the shapes a {family} of its config.json has "
                              f"(together {list(shapes[ours])})")
        weights[ours] = full.contiguous().clone()
    return weights


def check_exportable(config: GPTConfig) -> None:
    """One ConfigError line for a LLaMA-family choice LlamaForCausalLM cannot express."""
    check_llama_parts(config, "LlamaForCausalLM")
    if config.qk_layernorm:
        raise ConfigError("this model has --qk-layernorm: LlamaForCausalLM cannot compute it")


def check_llama_parts(config: GPTConfig, hf_class: str) -> None:
    """One ConfigError line for a choice none of HF's LLaMA-like classes (Llama, Mixtral, Qwen3-MoE) computes."""
    unsupported = [
        (config.normalization != "RMSNorm", f"--normalization {config.normalization} (Llama: RMSNorm)"),
        (not config.swiglu, "a GELU MLP (Llama: --swiglu)"),
        (config.position_embedding_type != "rope" or config.learned_positions,
         "positions other than RoPE alone (Llama: --position-embedding-type rope --no-position-embedding)"),
        (config.rotary_percent != 1.0, f"--rotary-percent {config.rotary_percent} (Llama rotates whole heads)"),
    ]
    for bad, what in unsupported:
        if bad:
            raise ConfigError(f"this model has {what}: {hf_class} cannot compute it")


def hf_config(config: GPTConfig, flags: dict, eod: int | None, dtype: str = "float32") -> dict:
    """config.json for `LlamaForCausalLM.from_pretrained`: every choice that changes the logits carried over.
    RoPE's theta both ways: `rope_parameters` (transformers v5) and `rope_theta` (v4)."""
    check_exportable(config)
    return config_json(config, flags, eod, dtype)


def config_json(config: GPTConfig, flags: dict, eod: int | None, dtype: str) -> dict:
    """hf_config's values, unchecked (Mixtral's and Qwen3-MoE's start from them)."""
    theta = float(config.rotary_base)
    return {**HF_DEFAULTS, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
            "intermediate_size": config.ffn_size, "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.query_groups,
            "head_dim": config.head_dim, "max_position_embeddings": config.max_position_embeddings,
            "initializer_range": config.init_method_std, "rms_norm_eps": config.layernorm_epsilon,
            "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
            "attention_bias": config.add_bias_linear, "mlp_bias": config.add_bias_linear,
            "attention_dropout": float(flags.get("attention_dropout", 0.0)),
            "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "rope_theta": theta,
            "bos_token_id": eod, "eos_token_id": eod, "pad_token_id": None, "use_cache": True, "dtype": dtype}


def _rope_theta(c: dict, source: str) -> float:
    """theta from v5's rope_parameters or v4's rope_theta; scaled RoPE is refused wherever a config says it: a
    Llama 3 config may carry v4's rope_scaling beside a default rope_parameters, and importing it unscaled would
    compute another model."""
    params, scaling = c.get("rope_parameters") or {}, c.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ConfigError(f"{source}: rope_parameters and rope_scaling must be objects")
    kinds = {kind for kind in (params.get("rope_type"), params.get("type"), scaling.get("rope_type"),
                               scaling.get("type")) if kind is not None}
    scaled = sorted(str(kind) for kind in kinds - {"default"})
    if scaled:
        raise ConfigError(f"{source} has RoPE scaling {scaled[0]!r}: mpzero's RoPE is unscaled, and importing it "
                          f"without would compute another model")
    theta = params.get("rope_theta", c.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta >= 1 or theta == float("inf"):
        raise ConfigError(f"{source}: rope_theta is {theta!r}, not a finite number >= 1 (it becomes --rotary-base)")
    return float(theta)


def config_from_hf(hf: dict, source: str) -> GPTConfig:
    """The mpzero GPTConfig computing what this Llama config.json computes; a choice mpzero cannot compute
    (activation, scaled RoPE, pretraining_tp) is one ConfigError line. head_dim other than hidden_size /
    num_attention_heads (Qwen3's 128, Gemma's) is --kv-channels."""
    c = {**HF_DEFAULTS, **{k: v for k, v in hf.items() if v is not None or k not in HF_DEFAULTS}}
    check_value_types(c, HF_DEFAULTS, source)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "max_position_embeddings", "head_dim"):
        if key == "head_dim" and c[key] is None:  # HF's default: hidden_size // num_attention_heads
            continue
        if not isinstance(c[key], int) or isinstance(c[key], bool) or c[key] < 1:
            raise ConfigError(f"{source}: {key} is {c[key]!r}, not a positive integer")
    heads = c["num_attention_heads"]
    groups = c["num_key_value_heads"] or heads
    unsupported = [
        (c["hidden_act"] != "silu", f"hidden_act {c['hidden_act']!r} (mpzero's gated MLP is SwiGLU: silu)"),
        (c["attention_bias"] != c["mlp_bias"], "attention_bias and mlp_bias differing (mpzero has one switch)"),
        (c["pretraining_tp"] != 1, f"pretraining_tp {c['pretraining_tp']}"),
    ]
    for bad, what in unsupported:
        if bad:
            raise ConfigError(f"{source} has {what}: mpzero cannot compute this model")
    config = GPTConfig(num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"], num_attention_heads=heads,
                       vocab_size=c["vocab_size"], max_position_embeddings=c["max_position_embeddings"],
                       hidden_dropout=0.0, attention_dropout=float(c["attention_dropout"]),
                       init_method_std=float(c["initializer_range"]), layernorm_epsilon=float(c["rms_norm_eps"]),
                       untie_embeddings_and_output_weights=not c["tie_word_embeddings"], normalization="RMSNorm",
                       swiglu=True, ffn_hidden_size=c["intermediate_size"], position_embedding_type="rope",
                       add_position_embedding=False, rotary_base=_rope_theta(c, source),
                       group_query_attention=groups != heads, num_query_groups=groups if groups != heads else None,
                       add_bias_linear=bool(c["attention_bias"]), kv_channels=_kv_channels(c))
    try:
        config.validate(1)
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None
    return config


def _kv_channels(c: dict) -> int | None:
    """--kv-channels for HF's head_dim: None where it is the default, hidden_size / num_attention_heads."""
    head_dim, hidden, heads = c["head_dim"], c["hidden_size"], c["num_attention_heads"]
    return None if head_dim is None or head_dim * heads == hidden else head_dim


def has_own_head_size(config: GPTConfig) -> bool:
    """Whether the head size is not hidden / heads: the model needs --kv-channels."""
    return config.attention_width != config.hidden_size


def model_flags(config: GPTConfig) -> dict:
    """The pretrain_gpt.py flags (by name) that build this model: recorded in an imported checkpoint's meta.json;
    GPT-2's (`hf_gpt2.model_flags`) less its GELU, plus the family's."""
    flags = {k: v for k, v in hf_gpt2.model_flags(config).items() if k != "openai_gelu"}
    return {**flags, **{k: v for k, v in config.architecture().items() if k in LLAMA_KEYS},
            "group_query_attention": config.group_query_attention, "add_position_embedding": False,
            **({"kv_channels": config.head_dim} if has_own_head_size(config) else {})}


LLAMA_KEYS = ("normalization", "swiglu", "ffn_hidden_size", "position_embedding_type", "rotary_base",
              "rotary_percent", "num_query_groups", "add_bias_linear")


def command_line(config: GPTConfig) -> list[str]:
    """The same model as pretrain_gpt.py arguments (for the line tools/import_hf.py prints)."""
    args = ["--num-layers", str(config.num_layers), "--hidden-size", str(config.hidden_size),
            "--num-attention-heads", str(config.num_attention_heads),
            "--max-position-embeddings", str(config.max_position_embeddings),
            "--norm-epsilon", repr(config.layernorm_epsilon), "--normalization", "RMSNorm", "--swiglu",
            "--ffn-hidden-size", str(config.ffn_size), "--position-embedding-type", "rope",
            "--no-position-embedding", "--rotary-base", str(int(config.rotary_base))]
    if config.group_query_attention:
        args += ["--group-query-attention", "--num-query-groups", str(config.query_groups)]
    if has_own_head_size(config):
        args += ["--kv-channels", str(config.head_dim)]
    if not config.add_bias_linear:
        args.append("--disable-bias-linear")
    if config.untie_embeddings_and_output_weights:
        args.append("--untie-embeddings-and-output-weights")
    return args
