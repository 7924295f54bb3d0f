"""mpzero's mixture-of-experts layers <-> Hugging Face's sparse MoE blocks (Mixtral, Qwen3-MoE), as the hub's files
store them: one tensor per expert. transformers 5 fuses a layer's experts in memory (`experts.gate_up_proj`
[E, 2f, h], `experts.down_proj` [E, h, f]) and converts the per-expert names on load and save
(transformers/conversion_mapping.py); mpzero writes the files' names and reads both.

    mpzero                                      HF file (`block`, `gate`/`up`/`down`: `MoENames`)
    layers.L.mlp.router.weight [E, h]           model.layers.L.<block>.gate.weight
    layers.L.mlp.experts.weight1 [E, 2f, h]     model.layers.L.<block>.experts.e.<gate>.weight [f, h] (rows :f of e),
                                                ....experts.e.<up>.weight (rows f:)
    layers.L.mlp.experts.weight2 [E, h, f]      model.layers.L.<block>.experts.e.<down>.weight

Routing: HF's softmax over all experts, top-k, renormalised over the k (Mixtral; Qwen3-MoE with norm_topk_prob)
gives the gates of a softmax over the k chosen logits, Megatron's default (and the same choice: softmax keeps the
order); without the renormalisation (Qwen3-MoE's norm_topk_prob false) it is --moe-router-pre-softmax. What these
classes cannot compute (sigmoid scores, the expert bias, group-limited routing, shared experts, biases) is refused.
Nothing here imports transformers.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from mpzero.errors import ConfigError
from mpzero.inference import hf_llama
from mpzero.models import GPTConfig

GATE, UP, DOWN = "expert-gate", "expert-up", "expert-down"  # kinds (kind, expert) of one expert's HF tensor


@dataclass(frozen=True)
class MoENames:
    """A class's names of an MoE layer's tensors in its files (model.layers.L.<block>.experts.e.<gate>.weight)."""
    block: str
    gate: str
    up: str
    down: str


def expert_pairs(config: GPTConfig, layer: int, names: MoENames) -> list[tuple[str, str, object]]:
    """(mpzero name, HF file name, conversion) of layer `layer`'s router and experts."""
    ours, theirs = f"layers.{layer}.mlp.", f"model.layers.{layer}.{names.block}."
    pairs = [(ours + "router.weight", theirs + "gate.weight", hf_llama.COPY)]
    for e in range(config.num_experts):
        expert = f"{theirs}experts.{e}."
        pairs += [(ours + "experts.weight1", f"{expert}{names.gate}.weight", (GATE, e)),
                  (ours + "experts.weight1", f"{expert}{names.up}.weight", (UP, e)),
                  (ours + "experts.weight2", f"{expert}{names.down}.weight", (DOWN, e))]
    return pairs


def _part(t: torch.Tensor, kind, config: GPTConfig) -> torch.Tensor:
    if isinstance(kind, tuple):
        what, e = kind
        return t[e] if what == DOWN else t[e].chunk(2, dim=0)[0 if what == GATE else 1]
    return hf_llama.part(t, kind, config)


def to_hf_state_dict(weights: dict[str, torch.Tensor], config: GPTConfig, pairs,
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The HF file's state dict of `pairs` from mpzero's full weights by name."""
    return {theirs: _part(weights[ours], kind, config).to(dtype).contiguous().clone() for ours, theirs, kind in pairs}


def _fuse(parts: dict, config: GPTConfig) -> torch.Tensor:
    """mpzero's tensor from its HF parts: an expert stack, a fused Llama tensor, or a copy."""
    if hf_llama.COPY in parts:
        return parts[hf_llama.COPY]
    if not any(isinstance(kind, tuple) for kind in parts):
        return hf_llama.fuse(parts, config)
    experts = range(config.num_experts)
    if (DOWN, 0) in parts:
        return torch.stack([parts[(DOWN, e)] for e in experts])
    return torch.stack([torch.cat([parts[(GATE, e)], parts[(UP, e)]], dim=0) for e in experts])


_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def unfused(state: dict[str, torch.Tensor], names: MoENames) -> dict[str, torch.Tensor]:
    """The state dict with transformers 5's in-memory fused experts (a state_dict() saved as is) split into the
    files' per-expert tensors, and Mixtral's in-memory `mlp.` block renamed to the files' name."""
    out = {}
    for key, t in state.items():
        match = _FUSED.match(key)
        if match is None:
            out[key.replace(".mlp.gate.", f".{names.block}.gate.")] = t
            continue
        prefix = f"model.layers.{match.group(1)}.{names.block}.experts."
        for e in range(t.shape[0]):
            if match.group(2) == "down_proj":
                out[f"{prefix}{e}.{names.down}.weight"] = t[e]
            else:
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}{e}.{names.gate}.weight"], out[f"{prefix}{e}.{names.up}.weight"] = gate, up
    return out


def converters(pairs_of, names: MoENames, hf_class: str, check_exportable):
    """(to_hf_state_dict(weights, config, dtype), from_hf_state_dict(state, config, source)) of an adapter whose
    `pairs_of(config)` names its tensors; the import reads the files' names and transformers 5's fused ones."""
    def to_hf(weights: dict[str, torch.Tensor], config: GPTConfig,
              dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        check_exportable(config)
        return to_hf_state_dict(weights, config, pairs_of(config), dtype)

    def from_hf(state: dict[str, torch.Tensor], config: GPTConfig, source: str) -> dict[str, torch.Tensor]:
        return hf_llama.from_hf_state_dict(unfused(state, names), config, source, pairs_of(config), hf_class, _fuse)
    return to_hf, from_hf


def check_routing_exportable(config: GPTConfig, hf_class: str) -> None:
    """One ConfigError line for an MoE choice neither Mixtral nor Qwen3-MoE computes."""
    unsupported = [
        (config.moe_router_score_function != "softmax",
         f"--moe-router-score-function {config.moe_router_score_function} (HF: softmax)"),
        (config.moe_router_enable_expert_bias, "--moe-router-enable-expert-bias"),
        (bool(config.moe_router_group_topk), "group-limited routing (--moe-router-group-topk)"),
        (bool(config.moe_shared_expert_intermediate_size), "shared experts"),
        (config.add_bias_linear, "biases (HF's experts have none: --disable-bias-linear)"),
        (config.moe_router_topk_scaling_factor is not None,
         f"--moe-router-topk-scaling-factor {config.moe_router_topk_scaling_factor} (HF: gates unscaled)"),
    ]
    for bad, what in unsupported:
        if bad:
            raise ConfigError(f"this model has {what}: {hf_class} cannot compute it")


def moe_config(dense: GPTConfig, experts, topk, width, layer_freq, pre_softmax: bool, source: str) -> GPTConfig:
    """`dense` (a LLaMA config) with the MoE layers the HF config says."""
    for key, value in (("experts", experts), ("experts per token", topk), ("expert width", width)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{source}: its {key} is {value!r}, not a positive integer")
    if topk == 1 and not pre_softmax:
        raise ConfigError(f"{source} routes each token to one expert with its gate renormalised to 1: mpzero's "
                          f"softmax router at top-1 takes --moe-router-pre-softmax (Megatron's rule), whose gate is "
                          f"the probability, so it would compute another model")
    config = dataclasses.replace(dense, num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=width,
                                 moe_layer_freq=layer_freq, moe_router_pre_softmax=pre_softmax)
    try:
        config.validate(1)
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None
    return config


def with_experts_key(hf: dict, key: str, alias: str, source: str) -> dict:
    """config.json with its expert count under `key`: Mixtral's and Qwen3-MoE's configs take num_experts and
    num_local_experts as one setting (their attribute_map; transformers 5 writes num_local_experts, the hub's
    Qwen3-MoE files num_experts); both, differing, is one ConfigError line."""
    if alias not in hf or hf[alias] is None:
        return hf
    if hf.get(key) is not None and hf[key] != hf[alias]:
        raise ConfigError(f"{source}: {key} {hf[key]!r} and {alias} {hf[alias]!r} differ (one setting in "
                          f"transformers): which is it?")
    return {**hf, key: hf[alias]}


def moe_layers(config: GPTConfig) -> list[int]:
    return [i for i in range(config.num_layers) if config.is_moe_layer(i)]


def moe_flags(config: GPTConfig) -> dict:
    """The MoE pretrain_gpt.py flags (by name) of an imported checkpoint's meta.json."""
    freq = config.moe_layer_freq
    return {"num_experts": config.num_experts, "moe_ffn_hidden_size": config.expert_ffn_size,
            "moe_layer_freq": list(freq) if isinstance(freq, tuple) else freq,
            "moe_router_topk": config.moe_router_topk, "moe_router_pre_softmax": config.moe_router_pre_softmax}


def moe_command_line(config: GPTConfig) -> list[str]:
    freq = config.moe_layer_freq
    args = ["--num-experts", str(config.num_experts), "--moe-router-topk", str(config.moe_router_topk),
            "--moe-ffn-hidden-size", str(config.expert_ffn_size)]
    if isinstance(freq, tuple):
        args += ["--moe-layer-freq", f"'[{','.join(str(x) for x in freq)}]'"]
    if config.moe_router_pre_softmax:
        args.append("--moe-router-pre-softmax")
    return args
