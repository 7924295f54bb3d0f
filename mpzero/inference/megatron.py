"""Megatron-core's GPT (megatron/core/models/gpt) -> mpzero's GPT: the names of its stored tensors, the model's
shape read from them (and from the flags the tensors cannot tell), and the weights.

megatron-core names a GPT's tensors in its sharded state dict, which is what a torch_dist checkpoint stores:
    embedding.word_embeddings.weight [padded vocab, h]     embedding.position_embeddings.weight [positions, h]
    decoder.layers.<part> [layers, ...]   or   decoder.layers.<i>.<part>      decoder.final_layernorm.weight/bias
    output_layer.weight (untied only: tied, the last pipeline stage's copy is not stored)
A layer's index is global whatever pipeline stage held it: a homogeneous stack stores each part once with the
layers along a leading dimension, a non-homogeneous one (and `singleton_local_shards`) one tensor per layer. The
norms before attention and MLP are named as fused into the next linear (`self_attention.linear_qkv.
layer_norm_weight`, `mlp.linear_fc1.layer_norm_weight`: TE specs, and the local spec's key map), or separately
(`input_layernorm.weight`, `pre_mlp_layernorm.weight`: specs without the map). Each part is an mpzero parameter
with no reordering:
- linear_qkv's rows go query group by query group, each group's query heads, then its key head, then its value
  head ([g, heads/g + 2, d]): mpzero's fused QKV layout, multi-head attention included (g = heads).
- A gated MLP's linear_fc1 is [gate; up] along the rows, as mpzero's fc1 (stored as the halves `weight_w` and
  `weight_v` with `singleton_local_shards`).
- Embedding and output rows past --vocab-size are Megatron's padding (--make-vocab-size-divisible-by x TP): dropped.
The tensors say the layers, widths, head size (linear_proj's columns / heads: --kv-channels), key/value groups,
normalization (LayerNorm has a bias, RMSNorm none), gated MLP, biases, tied output and learned positions; the user
says the heads, and RoPE's and the norm's settings.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from mpzero.errors import ConfigError
from mpzero.inference import hf_llama
from mpzero.inference.weights import expected_shapes
from mpzero.models import GPTConfig

ROOTS = ("embedding.", "decoder.", "output_layer.", "mtp.")  # the model's keys; others (optimizer.*, rng_state) skip
LAYERS = "decoder.layers."
TOP = {"embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
       "embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
       "decoder.final_layernorm.weight": "final_layernorm.weight",
       "decoder.final_layernorm.bias": "final_layernorm.bias", "output_layer.weight": "output_layer.weight"}
PARTS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
         "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
         "input_layernorm.weight": "input_layernorm.weight", "input_layernorm.bias": "input_layernorm.bias",
         "self_attention.linear_qkv.weight": "attention.qkv.weight",
         "self_attention.linear_qkv.bias": "attention.qkv.bias",
         "self_attention.linear_proj.weight": "attention.dense.weight",
         "self_attention.linear_proj.bias": "attention.dense.bias",
         "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
         "mlp.linear_fc1.layer_norm_bias": "post_attention_layernorm.bias",
         "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
         "pre_mlp_layernorm.bias": "post_attention_layernorm.bias",
         "mlp.linear_fc1.weight": "mlp.fc1.weight", "mlp.linear_fc1.bias": "mlp.fc1.bias",
         "mlp.linear_fc2.weight": "mlp.fc2.weight", "mlp.linear_fc2.bias": "mlp.fc2.bias"}
HALVES = ("_w", "_v")  # a gated linear_fc1 stored as gate (_w) and up (_v)
THEIRS = {ours: theirs for theirs, ours in reversed(list(PARTS.items()))}  # for messages: the TE-spec names
UNSUPPORTED = ("mixture-of-experts layers, QK layernorm, multi-latent attention and multi-token prediction do not "
               "import")


class Plan:
    """Where each mpzero parameter lies in the checkpoint: {name: [(key, layer index in a stacked key or None)]}
    (two entries: a gated fc1's halves, concatenated), and each stored tensor's shape."""

    def __init__(self, metadata: Metadata, source: str) -> None:
        self.source, self.sources, self.shapes = source, {}, {}
        for key, md in sorted(metadata.state_dict_metadata.items()):
            if not key.startswith(ROOTS) or key.split("/")[0].endswith("._extra_state"):
                continue  # the optimizer's and RNG's entries; TE's FP8 metadata (bytes)
            if not isinstance(md, TensorStorageMetadata):
                raise ConfigError(f"{source} holds {key} as bytes, not a tensor: not a megatron-core GPT")
            self._add(key, tuple(md.size))
        if "embedding.word_embeddings.weight" not in self.sources:
            raise ConfigError(f"{source} has no embedding.word_embeddings.weight: not a megatron-core GPT checkpoint "
                              f"(or one whose first pipeline stage did not save)")
        for name, entries in self.sources.items():
            if entries[0][0].endswith(HALVES) and len(entries) != 2:
                raise ConfigError(f"{source} holds {entries[0][0]} without its other half: the checkpoint is damaged")
            entries.sort(key=lambda entry: entry[0].endswith("_v"))  # gate (_w) first
        self.num_layers = 1 + max((int(n.split(".")[1]) for n in self.sources if n.startswith("layers.")), default=-1)

    def _add(self, key: str, size: tuple[int, ...]) -> None:
        """Place stored tensor `key`: a top-level one, one layer's part, or a part of every layer (stacked)."""
        if key in TOP:
            self._place(TOP[key], key, None, size)
            return
        part = key[len(LAYERS):] if key.startswith(LAYERS) else ""
        index, _, rest = part.partition(".")
        per_layer = index.isdigit()
        part = rest if per_layer else part
        base = part[:-2] if part.endswith(HALVES) and part[:-2] in ("mlp.linear_fc1.weight",
                                                                      "mlp.linear_fc1.bias") else part
        if base not in PARTS:
            raise ConfigError(f"{self.source} holds {key}, which mpzero's GPT has no part for ({UNSUPPORTED})")
        if per_layer:
            self._place(f"layers.{int(index)}.{PARTS[base]}", key, None, size)
        else:
            for layer in range(size[0] if size else 0):
                self._place(f"layers.{layer}.{PARTS[base]}", key, layer, size[1:])

    def _place(self, name: str, key: str, layer: int | None, size: tuple[int, ...]) -> None:
        entries = self.sources.setdefault(name, [])
        if entries and not (len(entries) == 1 and key.endswith(HALVES) and entries[0][0].endswith(HALVES)):
            raise ConfigError(f"{self.source} holds both {entries[0][0]} and {key} for mpzero's {name}: "
                              f"ambiguous, not a checkpoint megatron-core saved")
        entries.append((key, layer))
        self.shapes[name] = (self.shapes[name][0] + size[0], *size[1:]) if name in self.shapes else size

    def megatron_name(self, name: str) -> str:
        """The checkpoint's key for mpzero's `name` (the TE-spec name where it holds none)."""
        if name in self.sources:
            return self.sources[name][0][0]
        top = {ours: theirs for theirs, ours in TOP.items()}
        if name in top:
            return top[name]
        return LAYERS + THEIRS[name.split(".", 2)[2]] + f" of layer {name.split('.')[1]}"


def megatron_config(plan: Plan, given: dict) -> GPTConfig:
    """The GPT the tensors describe; `given`: the flags the user passed, by GPTConfig field name (num_attention_
    heads is required; the rest are checked against the tensors where these tell, else used)."""
    seen = _seen(plan, given["num_attention_heads"])
    _check_given(given, seen, plan.source)
    learned = "max_position_embeddings" in seen
    position = given.get("position_embedding_type") or ("learned_absolute" if learned else None)
    if position is None:
        raise ConfigError(f"{plan.source} has no learned position embedding: pass --position-embedding-type rope "
                          f"(with --rotary-base and --rotary-percent as trained) or none")
    if (position == "learned_absolute") != learned:
        raise ConfigError(f"--position-embedding-type {position} disagrees with the checkpoint, which "
                          f"{'holds' if learned else 'has no'} embedding.position_embeddings.weight")
    if not learned and not given.get("max_position_embeddings"):
        raise ConfigError("--max-position-embeddings is needed with RoPE or no position embedding: the longest "
                          "sequence the model is to run (Megatron's --max-position-embeddings)")
    rows = plan.shapes["embedding.word_embeddings.weight"][0]
    if given.get("vocab_size", rows) > rows:
        raise ConfigError(f"--vocab-size {given['vocab_size']} is more than the checkpoint's {rows} embedding rows")
    groups, heads, d = seen["num_query_groups"], given["num_attention_heads"], seen["kv_channels"]
    config = GPTConfig(**{**seen, "num_attention_heads": heads, "kv_channels": d if heads * d != seen["hidden_size"]
                          else None, "vocab_size": given.get("vocab_size", rows),
                          "max_position_embeddings": seen.get("max_position_embeddings",
                                                              given.get("max_position_embeddings")),
                          "position_embedding_type": position, "add_position_embedding": learned,
                          "group_query_attention": groups != heads,
                          "num_query_groups": groups if groups != heads else None,
                          **{k: given[k] for k in ("layernorm_epsilon", "openai_gelu", "rotary_base",
                                                   "rotary_percent") if k in given}})
    try:
        config.validate(1)
    except ConfigError as error:
        raise ConfigError(f"{plan.source}: {error}") from None
    return config


def _seen(plan: Plan, heads: int) -> dict:
    """What the tensors say, by GPTConfig field, given the number of heads (which they cannot say)."""
    hidden, source, shapes = plan.shapes["embedding.word_embeddings.weight"][1], plan.source, plan.shapes
    if plan.num_layers < 1 or "layers.0.attention.qkv.weight" not in shapes or "layers.0.mlp.fc2.weight" not in shapes:
        raise ConfigError(f"{source} has no decoder layers with linear_qkv and linear_fc2 weights: not a "
                          f"megatron-core GPT checkpoint (or one whose pipeline stages did not all save)")
    width = shapes.get("layers.0.attention.dense.weight", (hidden, hidden))[1]  # linear_proj: heads x kv_channels
    if width % heads:
        raise ConfigError(f"--num-attention-heads {heads} does not divide the checkpoint's attention width {width} "
                          f"(linear_proj's columns, heads x --kv-channels): pass the number the model was trained "
                          f"with")
    rows, head_dim = shapes["layers.0.attention.qkv.weight"][0], width // heads
    groups = (rows - width) // (2 * head_dim)
    if groups < 1 or rows != width + 2 * groups * head_dim or heads % groups:
        raise ConfigError(f"{source}: linear_qkv has {rows} rows, not (heads + 2 x groups) x {head_dim} for "
                          f"--num-attention-heads {heads} and any number of key/value groups: pass the heads it was "
                          f"trained with")
    fc1, ffn = shapes["layers.0.mlp.fc1.weight"][0], shapes["layers.0.mlp.fc2.weight"][1]
    if fc1 not in (ffn, 2 * ffn):
        raise ConfigError(f"{source}: linear_fc1 has {fc1} rows and linear_fc2 {ffn} columns: neither an MLP nor "
                          f"a gated one (SwiGLU)")
    seen = {"num_layers": plan.num_layers, "hidden_size": hidden, "ffn_hidden_size": ffn, "num_query_groups": groups,
            "kv_channels": head_dim,
            "normalization": "LayerNorm" if "final_layernorm.bias" in shapes else "RMSNorm",
            "swiglu": fc1 == 2 * ffn, "add_bias_linear": "layers.0.attention.qkv.bias" in shapes,
            "untie_embeddings_and_output_weights": "output_layer.weight" in shapes}
    if "embedding.position_embeddings.weight" in shapes:
        seen["max_position_embeddings"] = shapes["embedding.position_embeddings.weight"][0]
    return seen


def _check_given(given: dict, seen: dict, source: str) -> None:
    """Every flag the user passed agrees with what the tensors say, else one line naming it."""
    for field, value in seen.items():
        if field in given and given[field] != value:
            flag = {"add_bias_linear": "--disable-bias-linear"}.get(field, "--" + field.replace("_", "-"))
            said = "" if isinstance(given[field], bool) else f" {given[field]}"
            raise ConfigError(f"{flag}{said} disagrees with the checkpoint's tensors, which say {field} "
                              f"{value} ({source})")


def check_plan(plan: Plan, config: GPTConfig) -> None:
    """Every parameter of `config`'s GPT is in the checkpoint at its shape, and nothing else is."""
    expected = expected_shapes(config)
    expected["embedding.word_embeddings.weight"] = plan.shapes["embedding.word_embeddings.weight"]  # padded rows
    if config.untie_embeddings_and_output_weights:
        expected["output_layer.weight"] = expected["embedding.word_embeddings.weight"]
    for name in sorted(set(expected) | set(plan.shapes)):
        have, want = plan.shapes.get(name), expected.get(name)
        if have != want:
            there = f"is {list(have)}" if have is not None else "is absent"
            wanted = f"{list(want)} in" if want is not None else "absent from"
            raise ConfigError(f"{plan.source}: {plan.megatron_name(name)} {there}, {wanted} the GPT its other tensors "
                              f"and the flags describe (mpzero's GPT has biases in all linears or none, and norms "
                              f"of one kind)")


def weights_from(plan: Plan, stored: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """mpzero's full fp32 weights by name from the stored tensors (`stored`: by key, whole)."""
    weights = {}
    for name, entries in plan.sources.items():
        parts = [stored[key] if layer is None else stored[key][layer] for key, layer in entries]
        full = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)).float()
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            full = full[:config.vocab_size]  # Megatron's padding rows dropped
        weights[name] = full.contiguous().clone()
    return weights


def model_flags(config: GPTConfig) -> dict:
    """The pretrain_gpt.py flags (by name) that build this model: recorded in the imported checkpoint's meta.json
    (the LLaMA adapter's set covers every architecture choice; GELU's form and learned positions added back)."""
    return {**hf_llama.model_flags(config), "openai_gelu": config.openai_gelu,
            "add_position_embedding": config.learned_positions}


def command_line(config: GPTConfig) -> list[str]:
    """The same model as pretrain_gpt.py arguments (for the line tools/import_megatron.py prints)."""
    args = ["--num-layers", str(config.num_layers), "--hidden-size", str(config.hidden_size),
            "--num-attention-heads", str(config.num_attention_heads), "--ffn-hidden-size", str(config.ffn_size),
            "--max-position-embeddings", str(config.max_position_embeddings),
            "--norm-epsilon", repr(config.layernorm_epsilon), "--normalization", config.normalization]
    switches = [(config.swiglu, "--swiglu"), (config.openai_gelu, "--openai-gelu"),
                (config.group_query_attention, "--group-query-attention"),
                (not config.add_bias_linear, "--disable-bias-linear"),
                (config.untie_embeddings_and_output_weights, "--untie-embeddings-and-output-weights")]
    args += [flag for on, flag in switches if on]
    if config.group_query_attention:
        args += ["--num-query-groups", str(config.query_groups)]
    if hf_llama.has_own_head_size(config):
        args += ["--kv-channels", str(config.head_dim)]
    if not config.learned_positions:
        args += ["--position-embedding-type", config.position_embedding_type, "--no-position-embedding"]
    if config.position_embedding_type == "rope":
        args += ["--rotary-base", str(int(config.rotary_base)), "--rotary-percent", repr(config.rotary_percent)]
    return args
