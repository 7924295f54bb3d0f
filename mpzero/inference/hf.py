"""The Hugging Face adapters of mpzero's model families, one record each: GPT-2 (`GPT2LMHeadModel`, hf_gpt2.py) and
LLaMA (`LlamaForCausalLM`, hf_llama.py), keyed by config.json's model_type, which each family's record names
(`ModelFamily.hf_model_type`); a LLaMA-family model with mixture-of-experts layers is Mixtral
(`MixtralForCausalLM`, hf_mixtral.py), or, with --qk-layernorm too, Qwen3-MoE (`Qwen3MoeForCausalLM`,
hf_qwen3_moe.py). tools/export_hf.py picks the adapter by the checkpoint's config through its family, and
tools/import_hf.py by config.json's model_type; neither names a family."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from mpzero.errors import ConfigError
from mpzero.inference import hf_gpt2, hf_llama, hf_mixtral, hf_qwen3_moe
from mpzero.models import GPTConfig, family_of


@dataclass(frozen=True)
class HFAdapter:
    model_type: str  # config.json's
    architecture: str  # the transformers class
    title: str  # an export's README.md first line
    config_from_hf: Callable[[dict, str], GPTConfig]
    check_exportable: Callable[[GPTConfig], None]
    to_hf_state_dict: Callable
    from_hf_state_dict: Callable
    hf_config: Callable
    model_flags: Callable[[GPTConfig], dict]
    command_line: Callable[[GPTConfig], list[str]]
    describe: Callable[[GPTConfig], str]  # the choices beyond shapes, for the export's README
    embedding_keys: tuple[str, ...]  # the input embedding's name in a state dict (with and without a prefix)
    hf_flags: dict[str, str]  # each numeric config.json key: the pretrain_gpt.py flag (dest) it becomes


def _check_gpt2(config: GPTConfig) -> None:
    unsupported = [(config.group_query_attention, "grouped-query attention"),
                   (not config.add_bias_linear, "--disable-bias-linear"),
                   (config.ffn_size != 4 * config.hidden_size, f"--ffn-hidden-size {config.ffn_size}"),
                   (not config.learned_positions, "no learned position embedding"),
                   (config.qk_layernorm, "--qk-layernorm"),
                   (config.attention_width != config.hidden_size,
                    f"--kv-channels {config.head_dim} (GPT-2's heads split n_embd)")]
    for bad, what in unsupported:
        if bad:
            raise ConfigError(f"this model has {what}: GPT2LMHeadModel cannot compute it")


GPT2 = HFAdapter("gpt2", "GPT2LMHeadModel", "# GPT-2 exported from mpzero", hf_gpt2.gpt_config_from_hf, _check_gpt2,
                 hf_gpt2.to_hf_state_dict, hf_gpt2.from_hf_state_dict, hf_gpt2.hf_config, hf_gpt2.model_flags,
                 hf_gpt2.command_line,
                 lambda c: f"GELU {'tanh (--openai-gelu)' if c.openai_gelu else 'erf'}",
                 ("transformer.wte.weight", "wte.weight"), hf_gpt2.HF_FLAGS)
LLAMA = HFAdapter("llama", "LlamaForCausalLM", "# LLaMA exported from mpzero", hf_llama.config_from_hf,
                  hf_llama.check_exportable, hf_llama.to_hf_state_dict, hf_llama.from_hf_state_dict,
                  hf_llama.hf_config, hf_llama.model_flags, hf_llama.command_line,
                  lambda c: (f"{c.query_groups} key/value heads, SwiGLU width {c.ffn_size}, RoPE theta "
                             f"{c.rotary_base:g}, RMSNorm eps {c.layernorm_epsilon:g}"),
                  ("model.embed_tokens.weight",), hf_llama.HF_FLAGS)
MIXTRAL = HFAdapter("mixtral", "MixtralForCausalLM", "# Mixtral exported from mpzero", hf_mixtral.config_from_hf,
                    hf_mixtral.check_exportable, hf_mixtral.to_hf_state_dict, hf_mixtral.from_hf_state_dict,
                    hf_mixtral.hf_config, hf_mixtral.model_flags, hf_mixtral.command_line, hf_mixtral.describe,
                    ("model.embed_tokens.weight",), hf_mixtral.HF_FLAGS)
QWEN3_MOE = HFAdapter("qwen3_moe", "Qwen3MoeForCausalLM", "# Qwen3-MoE exported from mpzero",
                      hf_qwen3_moe.config_from_hf, hf_qwen3_moe.check_exportable, hf_qwen3_moe.to_hf_state_dict,
                      hf_qwen3_moe.from_hf_state_dict, hf_qwen3_moe.hf_config, hf_qwen3_moe.model_flags,
                      hf_qwen3_moe.command_line, hf_qwen3_moe.describe, ("model.embed_tokens.weight",),
                      hf_qwen3_moe.HF_FLAGS)
ADAPTERS = {adapter.model_type: adapter for adapter in (GPT2, LLAMA, MIXTRAL, QWEN3_MOE)}


def _moe_adapter(config: GPTConfig) -> HFAdapter | None:
    """A LLaMA-family model with MoE layers: Qwen3-MoE with --qk-layernorm, else Mixtral."""
    if family_of(config).hf_model_type != "llama":
        return None
    return QWEN3_MOE if config.qk_layernorm else MIXTRAL


def adapter_for_config(config: GPTConfig) -> HFAdapter:
    """The adapter of this model's family; a model neither HF class computes is one ConfigError line."""
    family = family_of(config)
    adapter = _moe_adapter(config) if config.num_experts else ADAPTERS.get(family.hf_model_type)
    if adapter is None:
        raise ConfigError(f"the {family.name} family has no Hugging Face class to export to"
                          + (" with mixture-of-experts layers" if config.num_experts else ""))
    adapter.check_exportable(config)
    return adapter


def tying_as_loaded(config: GPTConfig, state: dict[str, torch.Tensor], adapter: HFAdapter) -> tuple[GPTConfig, str]:
    """(the config as transformers loads these files, a note or ""): a config.json that ties the output layer to
    the embedding while its files hold an lm_head.weight of other values is loaded by transformers (5.x) with the
    stored head kept, untied (it warns); so is it here, and the import says so. A stored head equal to the
    embedding, or none, stays tied."""
    head = state.get("lm_head.weight")
    if config.untie_embeddings_and_output_weights or head is None:
        return config, ""
    embedding = next((state[key] for key in adapter.embedding_keys if key in state), None)
    if embedding is not None and head.shape == embedding.shape and torch.equal(head, embedding):
        return config, ""
    return (dataclasses.replace(config, untie_embeddings_and_output_weights=True),
            "; note: its config.json ties the output layer to the embedding but its files hold another lm_head.weight, "
            "which transformers keeps (untied): imported untied, as transformers computes it")


def adapter_for_hf(hf: dict, source: str) -> HFAdapter:
    model_type = hf.get("model_type")
    adapter = ADAPTERS.get(model_type) if isinstance(model_type, str) else None
    if adapter is None:
        known = [repr(k) for k in ADAPTERS]
        raise ConfigError(f"{source} has model_type {hf.get('model_type')!r}: only {', '.join(known[:-1])} and "
                          f"{known[-1]} models import")
    return adapter
