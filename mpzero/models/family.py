"""Model families, one record each (torchtitan's `ModelSpec`): everything the planner, the dry run, inference and
the tools need from a model, so none of them names a model class or its config.

    family = family_of(config)                        # the record of the family this config belongs to
    model = family.build(config, groups.tp, rng, device="meta")
    family.flops_per_token(config, tp_size), family.architecture(config), family.hf_model_type

GPT-2 and LLaMA are two entries over one transformer (`GPTModel`, its parts chosen by `GPTConfig` with Megatron's
flags): they share the config class, the flags, the build, the FLOPs, the activation setting and the TP traffic,
and differ in the configs they claim (`matches`) and their Hugging Face adapter (`inference/hf.py`). A third
family with a model of its own is its module(s) under `models/` and one record in `FAMILIES`, plus its HF adapter
in `inference/` if it has one, and a `--model-family` flag that picks `config_from_args` (today every family's
config comes from the transformer's flags, so no such flag exists yet).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from mpzero.errors import ConfigError
from mpzero.models.config import GPTConfig
from mpzero.models.gpt import GPTModel
from mpzero.tensor_parallel import amax_reduced_elements, layer_linears


@dataclass(frozen=True)
class ModelFamily:
    name: str
    config_cls: type
    config_from_args: Callable[[argparse.Namespace, int], Any]  # the parsed flags and the vocabulary -> its config
    build: Callable[..., nn.Module]  # (config, tp, rng=None, device=None, stage=None, cp=None, ep=None,
    # expert_tp=None) -> the model ("meta": no storage)
    flops_per_token: Callable[..., float]  # (config, tp_size, micro_batch_size=1) -> matmul FLOPs per token, fwd+bwd
    activation_setting: Callable | None  # (config, tp, micro_batch, seq, dtype, device, tp_rank, rng_streams)
    tp_comm_bytes: Callable | None  # (config, tp, micro_batch, seq, p, micro_batches, stage=None) -> TP bytes/iter
    hf_model_type: str | None  # its key in inference.hf.ADAPTERS (config.json's model_type); None: no HF class
    architecture: Callable[[Any], dict]  # {flag name: value} a checkpoint must agree with to load
    matches: Callable[[Any], bool]  # whether a config is of this family


def transformer_config(args: argparse.Namespace, vocab_size: int) -> GPTConfig:
    """The transformer the flags describe (Megatron's names; --seed seeds the initialization)."""
    return GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads, vocab_size=vocab_size,
                     max_position_embeddings=args.max_position_embeddings or args.seq_length,
                     hidden_dropout=args.hidden_dropout,
                     attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
                     layernorm_epsilon=args.layernorm_epsilon,
                     make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                     recompute_activations=args.recompute_activations,
                     recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
                     recompute_num_layers=args.recompute_num_layers,
                     distribute_saved_activations=args.distribute_saved_activations,
                     sequence_parallel=args.sequence_parallel, offload_activations=args.offload_activations,
                     layernorm_impl="auto" if args.layernorm_fusion else "torch",
                     softmax_impl="auto" if args.masked_softmax_fusion else "torch",
                     use_flash_attn=args.use_flash_attn, attention_backend=args.attention_backend,
                     torch_compile=args.torch_compile, cuda_graph_impl=args.cuda_graph_impl,
                     seq_length=args.seq_length,
                     untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
                     openai_gelu=args.openai_gelu, init_seed=args.seed,
                     cross_entropy_chunk_size=args.cross_entropy_chunk_size,
                     cross_entropy_impl="compile" if args.cross_entropy_loss_fusion else "auto",
                     normalization=args.normalization, swiglu=args.swiglu, ffn_hidden_size=args.ffn_hidden_size,
                     position_embedding_type=args.position_embedding_type,
                     add_position_embedding=args.add_position_embedding, rotary_base=args.rotary_base,
                     rotary_percent=args.rotary_percent, group_query_attention=args.group_query_attention,
                     num_query_groups=args.num_query_groups, add_bias_linear=args.add_bias_linear,
                     qk_layernorm=args.qk_layernorm, kv_channels=args.kv_channels,
                     context_parallel_size=args.context_parallel_size, cp_comm_type=args.cp_comm_type,
                     fp8_format=args.fp8_format, fp8_recipe=args.fp8_recipe,
                     fp8_auto_filter_small_kn=args.fp8_auto_filter_small_kn,
                     first_last_layers_bf16=args.first_last_layers_bf16,
                     num_layers_at_start_in_bf16=args.num_layers_at_start_in_bf16,
                     num_layers_at_end_in_bf16=args.num_layers_at_end_in_bf16,
                     **{name: getattr(args, name) for name in MOE_FIELDS})


MOE_FIELDS = ("num_experts", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_topk", "moe_router_score_function",
              "moe_router_pre_softmax", "moe_router_num_groups", "moe_router_group_topk",
              "moe_router_enable_expert_bias", "moe_shared_expert_intermediate_size", "moe_router_load_balancing_type",
              "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate", "moe_router_dtype",
              "moe_expert_capacity_factor", "moe_token_drop_policy", "moe_token_dispatcher_type", "moe_grouped_gemm",
              "moe_router_topk_scaling_factor")


def transformer_tp_comm_bytes(config: GPTConfig, tp: int, micro_batch: int, seq: int, p: int,
                              micro_batches: int, stage=None) -> float:
    """Bytes per rank per iteration on the TP group (ring model: an all-reduce of B bytes moves 2B(t-1)/t, an
    all-gather or reduce-scatter of a B-byte whole B(t-1)/t), for the transformer `config` (its recomputation and
    sequence-parallel settings), B = b s h p the bytes of one [b, s, h] activation. Per micro-batch:
      each layer     forward: the attention and MLP outputs all-reduced (4B); backward: the QKV and fc1 input
                     gradients all-reduced (4B). Sequence parallel: forward 2 all-gathers + 2 reduce-scatters
                     (4B), backward the inputs gathered again, their gradients reduce-scattered and the outputs'
                     gradients gathered (6B), plus the LayerNorms' fp32 weight and bias gradients (2 x 2 x 8h)
                     and the row-parallel biases' (2 x 2ph) all-reduced (RMSNorm: weights only; none
                     of the biases with --disable-bias-linear); --qk-layernorm: the q and k norms' fp32 weight
                     gradients all-reduced (2 x 2 x 4d), with or without SP
      recomputation  full: each recomputed layer's forward again (4B); distributed checkpoints: each one
                     all-gathered before its replay (B); selective: none (the core attention has no TP traffic)
      outside        the embedding's all-reduce (2B; sequence parallel + its slice's gradient gathered, B), the
                     output projection's input (2B all-reduced backward; sequence parallel: gathered forward and
                     backward, its gradient reduce-scattered, 3B), the final LayerNorm's parameters (SP: 16h),
                     the cross entropy's three fp32 [b, s] all-reduces (24bs)
      FP8            each FP8 linear's fp32 amaxes of split tensors, all-reduced (`_fp8_amax_elements`)
    all times (t-1)/t. Under context parallelism a rank's activations hold its s/CP tokens. A pipeline stage
    (`stage`, a `ModelStage`) counts its own layers (recomputation's rules per model chunk), the embedding's terms
    where it begins the model and the rest of the outside terms where it ends it."""
    if tp == 1:
        return 0.0
    r = (tp - 1) / tp
    h = config.hidden_size
    chunks = [config.num_layers] if stage is None else [len(chunk) for chunk in stage.chunks]
    first, last = (True, True) if stage is None else (stage.first, stage.last)
    seq //= config.context_parallel_size
    B = micro_batch * seq * h * p
    sp = config.sequence_parallel
    recomputed = checkpoints = 0
    if config.granularity == "full":
        method, n = config.resolved_recompute_method, config.resolved_recompute_num_layers
        recomputed = sum(c if method == "uniform" else min(n, c) for c in chunks)
        checkpoints = sum(-(-c // n) if method == "uniform" else min(n, c) for c in chunks)
    norm_params = 1 if config.normalization == "RMSNorm" else 2  # RMSNorm: no bias
    biases = 4 * h * p if config.add_bias_linear else 0
    layer = (10 * B + 16 * norm_params * h + biases) if sp else 8 * B
    if config.qk_layernorm:  # the q and k norms' fp32 [d] weight gradients, all-reduced at any SP (2 x 2 x 4d)
        layer += 16 * config.head_dim
    total = sum(chunks) * layer + recomputed * 4 * B
    if config.distribute_saved_activations:
        total += checkpoints * B
    if first:
        total += 3 * B if sp else 2 * B
    if last:
        total += (3 * B + 8 * norm_params * h if sp else 2 * B) + 24 * micro_batch * seq
    layers = range(config.num_layers) if stage is None else [i for chunk in stage.chunks for i in chunk]
    total += 8 * _fp8_amax_elements(config, tp, micro_batch * seq, layers)
    return total * r * micro_batches


def _fp8_amax_elements(config: GPTConfig, tp: int, tokens: int, layers) -> int:
    """--fp8-format: the fp32 amaxes one micro-batch all-reduces over TP in `layers` (each FP8 linear's casts of
    split tensors, `tensor_parallel.fp8.amax_reduced_elements`; an all-reduce of n moves 8n(t-1)/t bytes per rank)."""
    if config.fp8 is None:
        return 0
    per_layer = sum(amax_reduced_elements(config.fp8, kind, k, n, tp, tokens) for kind, k, n in layer_linears(config)
                    if config.fp8.chooses(n, k))
    return per_layer * len(set(layers) - config.bf16_layers())


def is_llama(config: GPTConfig) -> bool:
    """Whether the transformer is of the LLaMA family (RMSNorm, SwiGLU or RoPE; exported as LlamaForCausalLM)."""
    return config.normalization == "RMSNorm" or config.swiglu or config.position_embedding_type == "rope"


def _transformer(name: str, hf_model_type: str, matches: Callable[[GPTConfig], bool]) -> ModelFamily:
    return ModelFamily(name, GPTConfig, transformer_config, GPTModel, GPTConfig.flops_per_token,
                       GPTConfig.activation_setting, transformer_tp_comm_bytes, hf_model_type, GPTConfig.architecture,
                       lambda config: isinstance(config, GPTConfig) and matches(config))


GPT2 = _transformer("gpt2", "gpt2", lambda config: not is_llama(config))
LLAMA = _transformer("llama", "llama", is_llama)
FAMILIES = {family.name: family for family in (GPT2, LLAMA)}


def config_from_args(args: argparse.Namespace, vocab_size: int, family: str = "gpt2"):
    """The config the parsed flags describe, by the family's own `config_from_args`. GPT-2 and LLaMA share the
    transformer's flags (they differ in values, and `family_of` tells them apart afterwards), so the default
    serves both; a family with flags of its own is picked by name (a `--model-family` flag, once there is one)."""
    return FAMILIES[family].config_from_args(args, vocab_size)


def family_of(config) -> ModelFamily:
    """The family whose record claims `config`; a config no family claims is one ConfigError line."""
    for family in FAMILIES.values():
        if family.matches(config):
            return family
    raise ConfigError(f"no model family takes a {type(config).__name__}: known families are "
                      f"{', '.join(FAMILIES)} (mpzero.models.FAMILIES)")
