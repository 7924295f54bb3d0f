"""From a checkpoint's full weights to a GPT model at any TP size.

`read_consolidated` (tools/checkpoint_util.py) gives every parameter as one full fp32 tensor by name, whatever
TP x DP x ZeRO layout saved it; this module turns its meta.json into the `GPTConfig` the run trained, checks
that the weights are that model's (names and global shapes), and hands each TP rank its slice:

    config = gpt_config_from_meta(meta, directory)
    check_gpt_weights(weights, config, directory)
    model = family_of(config).build(config, groups.tp, device=groups.device)
    load_full_weights(model, weights)
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from mpzero.comm import CommGroup
from mpzero.errors import ConfigError
from mpzero.models import GPTConfig, family_of
from mpzero.moe import MoELayer
from mpzero.tensor_parallel import RNGStatesTracker, placements, tp_slice

# The GPTConfig fields a checkpoint must state (meta["architecture"], else the run's flags in meta["config"]).
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings")
OPTIONAL = ("layernorm_epsilon", "untie_embeddings_and_output_weights", "openai_gelu", "init_method_std",
            "make_vocab_size_divisible_by", "normalization", "swiglu", "ffn_hidden_size", "position_embedding_type",
            "add_position_embedding", "rotary_base", "rotary_percent", "group_query_attention", "num_query_groups",
            "add_bias_linear", "qk_layernorm", "kv_channels", "num_experts", "moe_ffn_hidden_size", "moe_layer_freq",
            "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax", "moe_router_num_groups",
            "moe_router_group_topk", "moe_router_enable_expert_bias", "moe_shared_expert_intermediate_size",
            "moe_router_topk_scaling_factor")


def gpt_config_from_meta(meta: dict, directory: str) -> GPTConfig:
    """The model the checkpoint's run trained, with dropout and recomputation off (inference; the run's dropout
    rates stay in meta["config"])."""
    flags = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    saved = {**flags, **(meta.get("architecture") or {})}
    missing = [name for name in REQUIRED if not isinstance(saved.get(name), int)]
    if missing:
        raise ConfigError(f"checkpoint {directory} does not state its model's --{missing[0].replace('_', '-')} in "
                          f"meta.json: not a GPT checkpoint written by pretrain_gpt.py or tools/import_hf.py")
    known = {name: saved[name] for name in REQUIRED + OPTIONAL if saved.get(name) is not None}
    if isinstance(known.get("moe_layer_freq"), list):  # a 0/1 pattern, stored as a JSON list
        known["moe_layer_freq"] = tuple(known["moe_layer_freq"])
    groups = known.get("num_query_groups")  # the architecture record states the groups, not the flag turning them on
    if groups is not None and groups != known["num_attention_heads"]:
        known["group_query_attention"] = True
    elif not known.get("group_query_attention"):
        known.pop("num_query_groups", None)
    config = GPTConfig(**known, layernorm_impl="auto" if flags.get("layernorm_fusion", True) else "torch",
                       softmax_impl="auto" if flags.get("masked_softmax_fusion", True) else "torch")
    return dataclasses.replace(config, hidden_dropout=0.0, attention_dropout=0.0, recompute_activations=False)


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """{parameter name: global shape} of the model of `config`, as its family builds it (on the meta device: no
    storage, nothing drawn) at TP 1; the vocabulary unpadded, as checkpoints store it."""
    with torch.device("meta"):  # buffers too (RoPE's tables)
        model = family_of(config).build(config, CommGroup(None, (0,), 0), RNGStatesTracker(torch.device("cpu")),
                                        device="meta")
    return {name: placement.global_shape(1) for name, placement in placements(model.named_parameters()).items()}


def check_gpt_weights(weights: dict[str, torch.Tensor], config: GPTConfig, source: str) -> None:
    """One ConfigError line naming the first parameter that is missing, extra or of another shape than the
    GPT of `config` has (a checkpoint of another architecture, or a meta.json that does not match its weights)."""
    expected = expected_shapes(config)
    for name in sorted(set(expected) | set(weights)):
        have = tuple(weights[name].shape) if name in weights else None
        if have != expected.get(name):
            there = list(have) if have is not None else "absent"
            wanted = list(expected[name]) if name in expected else "absent"
            raise ConfigError(f"{source} is not the GPT its meta.json describes ({config.num_layers} layers, hidden "
                              f"{config.hidden_size}, vocabulary {config.vocab_size}): {name} is {there} there, "
                              f"{wanted} in that model")


def load_full_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into this rank's parameters: sharded ones padded (the vocabulary) and sliced along
    their partition dimension, replicated ones whole; an expert stack cut to this expert-parallel rank's experts
    first, then each expert split over its expert-TP group."""
    where, grids = placements(model.named_parameters()), _expert_groups(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            full, placement = weights[name].float(), where[name]
            tp = model.tp
            if placement.expert:
                ep, tp = grids[name]
                local = full.size(0) // ep.size
                full = full[ep.rank * local:(ep.rank + 1) * local]
            if placement.partition_dim is not None:
                dim = placement.partition_dim
                padded = placement.local_shape[dim] * tp.size
                if full.size(dim) < padded:  # zero rows past the real vocabulary, as the model starts with
                    pad = [0, 0] * (full.dim() - 1 - dim) + [0, padded - full.size(dim)]
                    full = F.pad(full, pad)
                full = tp_slice(full, dim, tp.size, tp.rank, placement.chunks)
            param.copy_(full)


def _expert_groups(model: nn.Module) -> dict[str, tuple[CommGroup, CommGroup]]:
    """{expert parameter name: (its EP group, its expert-TP group)}, from the MoE layers that hold them."""
    groups = {}
    for prefix, module in model.named_modules():
        if isinstance(module, MoELayer):
            for name, _ in module.experts.named_parameters():
                groups[f"{prefix}.experts.{name}"] = (module.ep, module.etp)
    return groups
