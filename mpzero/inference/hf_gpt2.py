"""mpzero's GPT <-> Hugging Face GPT-2 (`transformers.GPT2LMHeadModel`): weights, config.json, and what cannot map.

The two models compute the same function; only the storage differs:
- HF's `Conv1D` stores [in, out] (y = x W + b), mpzero's linears [out, in] (y = x W^T + b): every matrix of a
  block is transposed (c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj).
- mpzero's fused QKV rows are laid out head by head, [heads, (q, k, v), head_dim] (a contiguous TP split hands
  each rank whole heads); HF's c_attn columns are [(q, k, v), heads, head_dim], the q block, then k, then v.
- Tied output weights are not stored by HF (`lm_head.weight` is `transformer.wte.weight`); untied ones are.
- Activation: mpzero's `--openai-gelu` is GPT-2's tanh GELU ("gelu_new"), its default the exact erf GELU ("gelu").
Vocabulary padding never reaches HF: checkpoints store the real rows only. Nothing here imports transformers.
"""

from __future__ import annotations

import re

import torch

from mpzero.errors import ConfigError
from mpzero.inference.hf_values import check_value_types
from mpzero.inference.weights import expected_shapes
from mpzero.models import GPTConfig

COPY, TRANSPOSE, QKV_WEIGHT, QKV_BIAS = "copy", "transpose", "qkv_weight", "qkv_bias"
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_python_tanh")  # GPT-2's tanh approximation
ERF_GELUS = ("gelu", "gelu_python")
_LAYER = (("input_layernorm.weight", "ln_1.weight", COPY), ("input_layernorm.bias", "ln_1.bias", COPY),
          ("attention.qkv.weight", "attn.c_attn.weight", QKV_WEIGHT),
          ("attention.qkv.bias", "attn.c_attn.bias", QKV_BIAS),
          ("attention.dense.weight", "attn.c_proj.weight", TRANSPOSE),
          ("attention.dense.bias", "attn.c_proj.bias", COPY),
          ("post_attention_layernorm.weight", "ln_2.weight", COPY),
          ("post_attention_layernorm.bias", "ln_2.bias", COPY),
          ("mlp.fc1.weight", "mlp.c_fc.weight", TRANSPOSE), ("mlp.fc1.bias", "mlp.c_fc.bias", COPY),
          ("mlp.fc2.weight", "mlp.c_proj.weight", TRANSPOSE), ("mlp.fc2.bias", "mlp.c_proj.bias", COPY))
# HF's defaults (transformers GPT2Config) for keys a config.json may leave out
HF_DEFAULTS = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
               "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
               "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "scale_attn_weights": True,
               "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
               "add_cross_attention": False, "tie_word_embeddings": True}
# each numeric key's pretrain_gpt.py flag (its range: mpzero/cli/flag_ranges.py); embd_pdrop is a dropout too
HF_FLAGS = {"vocab_size": "vocab_size", "n_positions": "max_position_embeddings", "n_embd": "hidden_size",
            "n_layer": "num_layers", "n_head": "num_attention_heads", "n_inner": "ffn_hidden_size",
            "resid_pdrop": "hidden_dropout", "embd_pdrop": "hidden_dropout", "attn_pdrop": "attention_dropout",
            "layer_norm_epsilon": "layernorm_epsilon", "initializer_range": "init_method_std"}
# buffers older transformers releases saved with the weights (the causal mask): not parameters, dropped on import
_OLD_BUFFERS = re.compile(r"^transformer\.h\.\d+\.attn\.(bias|masked_bias)$")


def name_pairs(config: GPTConfig) -> list[tuple[str, str, str]]:
    """(mpzero name, HF name, conversion) for every parameter of the model."""
    pairs = [("embedding.word_embeddings.weight", "transformer.wte.weight", COPY),
             ("embedding.position_embeddings.weight", "transformer.wpe.weight", COPY)]
    for i in range(config.num_layers):
        pairs += [(f"layers.{i}.{ours}", f"transformer.h.{i}.{theirs}", kind) for ours, theirs, kind in _LAYER]
    pairs += [("final_layernorm.weight", "transformer.ln_f.weight", COPY),
              ("final_layernorm.bias", "transformer.ln_f.bias", COPY)]
    if config.untie_embeddings_and_output_weights:
        pairs.append(("output_layer.weight", "lm_head.weight", COPY))
    return pairs


def _to_hf(t: torch.Tensor, kind: str, heads: int) -> torch.Tensor:
    if kind == TRANSPOSE:
        return t.t()
    if kind in (QKV_WEIGHT, QKV_BIAS):  # rows [heads, 3, head_dim] -> [3, heads, head_dim]
        blocks = t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
        return blocks.t() if kind == QKV_WEIGHT else blocks
    return t


def _from_hf(t: torch.Tensor, kind: str, heads: int) -> torch.Tensor:
    if kind == TRANSPOSE:
        return t.t()
    if kind in (QKV_WEIGHT, QKV_BIAS):  # columns [3, heads, head_dim] -> rows [heads, 3, head_dim]
        blocks = t.t() if kind == QKV_WEIGHT else t
        return blocks.reshape(3, heads, -1, *blocks.shape[1:]).transpose(0, 1).reshape(blocks.shape)
    return t


def to_hf_state_dict(weights: dict[str, torch.Tensor], config: GPTConfig,
                     dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """HF GPT2LMHeadModel's state dict (as `save_pretrained` stores it) from mpzero's full weights by name."""
    heads = config.num_attention_heads
    return {theirs: _to_hf(weights[ours], kind, heads).to(dtype).contiguous().clone()
            for ours, theirs, kind in name_pairs(config)}


def known_tensors(state: dict[str, torch.Tensor], config: GPTConfig, pairs, old_buffers: re.Pattern, source: str,
                  family: str, hf_class: str) -> dict[str, torch.Tensor]:
    """An HF state dict less the buffers older releases saved and, tied, the output weight (HF reads it from the
    embedding whatever the file holds); a tensor no name pair expects is one ConfigError line."""
    state = {key: t for key, t in state.items() if not old_buffers.match(key)}
    if not config.untie_embeddings_and_output_weights:
        state.pop("lm_head.weight", None)
    unexpected = sorted(set(state) - {theirs for _, theirs, _ in pairs})
    if unexpected:
        raise ConfigError(f"{source} holds {unexpected[0]}, which a {family} of its config.json does not have "
                          f"({len(unexpected)} such tensors): not a {hf_class} this mpzero can import")
    return state


def from_hf_state_dict(state: dict[str, torch.Tensor], config: GPTConfig, source: str) -> dict[str, torch.Tensor]:
    """mpzero's full fp32 weights by name from an HF GPT-2 state dict (keys with or without `transformer.`);
    a missing, unexpected or misshapen tensor is one ConfigError line."""
    state = {key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key: t
             for key, t in state.items()}
    pairs = name_pairs(config)
    state = known_tensors(state, config, pairs, _OLD_BUFFERS, source, "GPT-2", "GPT2LMHeadModel")
    heads, shapes, weights = config.num_attention_heads, expected_shapes(config), {}
    for ours, theirs, kind in pairs:
        if theirs not in state:
            raise ConfigError(f"{source} has no {theirs}: not a complete GPT2LMHeadModel of its config.json")
        t = state[theirs]
        wanted = tuple(reversed(shapes[ours])) if kind in (TRANSPOSE, QKV_WEIGHT) else shapes[ours]
        if tuple(t.shape) != wanted:
            raise ConfigError(f"{source}: {theirs} is {list(t.shape)}, a GPT-2 of its config.json has "
                              f"{list(wanted)}")
        weights[ours] = _from_hf(t.float(), kind, heads).contiguous().clone()
    return weights


def hf_config(config: GPTConfig, flags: dict, eod: int | None, dtype: str = "float32") -> dict:
    """config.json for `GPT2LMHeadModel.from_pretrained`: every choice that changes the logits carried over."""
    hidden_dropout = float(flags.get("hidden_dropout", 0.1))
    return {**HF_DEFAULTS, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": config.vocab_size, "n_positions": config.max_position_embeddings,
            "n_embd": config.hidden_size, "n_layer": config.num_layers, "n_head": config.num_attention_heads,
            "n_inner": 4 * config.hidden_size, "activation_function": "gelu_new" if config.openai_gelu else "gelu",
            "resid_pdrop": hidden_dropout, "embd_pdrop": hidden_dropout,
            "attn_pdrop": float(flags.get("attention_dropout", 0.1)), "layer_norm_epsilon": config.layernorm_epsilon,
            "initializer_range": config.init_method_std,
            "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
            "bos_token_id": eod, "eos_token_id": eod, "pad_token_id": None, "use_cache": True, "dtype": dtype}


def gpt_config_from_hf(hf: dict, source: str) -> GPTConfig:
    """The mpzero GPTConfig computing what this GPT-2 config.json computes; a choice mpzero's GPT does not have
    (another model type, activation, MLP width, attention scaling, cross-attention) is one ConfigError line."""
    if hf.get("model_type") != "gpt2":
        raise ConfigError(f"{source} has model_type {hf.get('model_type')!r}, not 'gpt2': only GPT-2 models import")
    c = {**HF_DEFAULTS, **hf}
    check_value_types(c, HF_DEFAULTS, source)
    for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
        if not isinstance(c[key], int) or isinstance(c[key], bool) or c[key] < 1:
            raise ConfigError(f"{source}: {key} is {c[key]!r}, not a positive integer")
    unsupported = [
        (c["activation_function"] not in TANH_GELUS + ERF_GELUS,
         f"activation_function {c['activation_function']!r} (mpzero has GELU: {', '.join(TANH_GELUS + ERF_GELUS)})"),
        (c["n_inner"] not in (None, 4 * c["n_embd"]), f"n_inner {c['n_inner']} (mpzero's MLP is 4 x n_embd)"),
        (not c["scale_attn_weights"], "scale_attn_weights false (mpzero scales scores by 1/sqrt(head_dim))"),
        (c["scale_attn_by_inverse_layer_idx"], "scale_attn_by_inverse_layer_idx true"),
        (c["add_cross_attention"], "add_cross_attention true"),
    ]
    for bad, what in unsupported:
        if bad:
            raise ConfigError(f"{source} has {what}: mpzero's GPT cannot compute this model")
    config = GPTConfig(num_layers=c["n_layer"], hidden_size=c["n_embd"], num_attention_heads=c["n_head"],
                       vocab_size=c["vocab_size"], max_position_embeddings=c["n_positions"],
                       hidden_dropout=float(c["resid_pdrop"]), attention_dropout=float(c["attn_pdrop"]),
                       init_method_std=float(c["initializer_range"]), layernorm_epsilon=float(c["layer_norm_epsilon"]),
                       untie_embeddings_and_output_weights=not c["tie_word_embeddings"],
                       openai_gelu=c["activation_function"] in TANH_GELUS)
    try:
        config.validate(1)
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None
    return config


def model_flags(config: GPTConfig) -> dict:
    """The pretrain_gpt.py flags (by name) that build this model: recorded in an imported checkpoint's meta.json."""
    return {"num_layers": config.num_layers, "hidden_size": config.hidden_size,
            "num_attention_heads": config.num_attention_heads, "vocab_size": config.vocab_size,
            "max_position_embeddings": config.max_position_embeddings, "seq_length": config.max_position_embeddings,
            "layernorm_epsilon": config.layernorm_epsilon, "init_method_std": config.init_method_std,
            "hidden_dropout": config.hidden_dropout, "attention_dropout": config.attention_dropout,
            "untie_embeddings_and_output_weights": config.untie_embeddings_and_output_weights,
            "openai_gelu": config.openai_gelu}


def command_line(config: GPTConfig) -> list[str]:
    """The same model as pretrain_gpt.py arguments (for the line tools/import_hf.py prints)."""
    args = ["--num-layers", str(config.num_layers), "--hidden-size", str(config.hidden_size),
            "--num-attention-heads", str(config.num_attention_heads),
            "--max-position-embeddings", str(config.max_position_embeddings),
            "--layernorm-epsilon", repr(config.layernorm_epsilon)]
    if config.openai_gelu:
        args.append("--openai-gelu")
    if config.untie_embeddings_and_output_weights:
        args.append("--untie-embeddings-and-output-weights")
    return args
