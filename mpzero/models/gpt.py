"""The transformer: GPT-2 and the LLaMA family, built from the tensor-parallel layers and the parts in
`models/blocks.py` (norms, MLP, dropout) and `models/attention.py`, as the config (`models/config.py`) chooses.

Learned positions, pre-LayerNorm blocks, causal self-attention with heads split across the TP group,
GELU MLP of width 4h (erf, or tanh with `openai_gelu`), final LayerNorm, output projection tied to the
vocab-parallel input embedding (or its own column-parallel weight with `untie_embeddings_and_output_weights`).
Activations are [batch, seq, hidden]. The model knows TP (it takes `groups.tp`) but not ZeRO.

The LLaMA family is the same transformer with other parts, chosen by the config with Megatron's flags:
RMSNorm (`models/norms.py`), a SwiGLU MLP whose [gate; up] weight is split so each TP rank holds matching
halves (the gated `blocks.MLP`), RoPE in HF's rotate-half convention (`models/rotary.py`), grouped-query attention
(K/V groups split across TP with their query heads), no biases, untied output weights.

As a library:

    model = GPTModel(GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1000,
                               max_position_embeddings=128, hidden_dropout=0.0, attention_dropout=0.0),
                     init_parallel().tp)                      # no RNG tracker needed without dropout
    loss = model(tokens, labels, reduction="mean")

Initialization is deferred (`mpzero.deferred_init`): every parameter is created without storage, with its
recipe, keyed by its name and seeded with `config.init_seed`, and drawn from a CPU generator of its own when it is
made: building a model never touches torch's global RNG, and the weights are the same at every TP size (each rank
draws every full weight and keeps its slice), on CPU and CUDA (drawn on the CPU, then moved), and whether the model
is made whole (`device` a real device) or left without storage (`device="meta"`) for ZeRO to make one unit or
bucket at a time, straight into this rank's shard (`ZeroOptimizer`; what `pretrain_gpt.py` does). Dropout draws
from torch's default generator (hidden dropout, identical on every TP rank when seeded alike) and from the tracker's
tensor-parallel stream (attention dropout): the caller seeds those (`seed_everything`).

Activation memory (Megatron's flags, Korthikanti et al. 2022): `recompute_activations` / granularity "selective"
recomputes the core attention in backward; granularity "full" recomputes whole layers (method uniform: chunks
of N layers, each chunk's input kept; block: the first N layers); `distribute_saved_activations` keeps each
full-recomputation checkpoint as a 1/t slice per TP rank; `sequence_parallel` runs LayerNorms, dropouts and
residual adds on a 1/t slice of the sequence (hidden dropout then draws from the tracker's stream, the
LayerNorm and row-parallel bias gradients are all-reduced over TP); `offload_activations` "cpu" keeps the
checkpoints (full) or every tensor a layer saves in host memory (`save_on_cpu`). Replays draw the same masks.
What each mode keeps is `mpzero.activations.formula`, counted against it at the start of training.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from mpzero.activations import COMPILED_TRUNK, ActivationSetting, activation_region, host_offload, moe_shape
from mpzero.comm import CommGroup
from mpzero.context_parallel import ContextParallel
from mpzero.deferred_init import deferred_parameter, materialize_module, name_parameters
from mpzero.errors import ConfigError
from mpzero.models.attention import AttentionConfig, SelfAttention
from mpzero.models.blocks import MLP, HiddenDropout, gelu, gelu_tanh, norm, normal_init, vocab_rows_init
from mpzero.models.compiled import has_module_hooks, compile_layers, compile_trunk, trunk_compilable
from mpzero.models.config import GPTConfig
from mpzero.models.kv_cache import KVCache
from mpzero.models.moe_block import ExpertGrid, moe_block
from mpzero.models.rotary import RotaryEmbedding
from mpzero.models.stage import LayerStack, ModelStage
from mpzero.moe import MoEMetrics, check_expert_grid, experts_impl
from mpzero.tensor_parallel import (ColumnParallelLinear, RNGStatesTracker, VocabParallelEmbedding, copy_to_tp,
                                    linear_with_sequence_gather, mark_pipeline_tied, mark_tensor_parallel, recompute,
                                    scatter_to_sequence_parallel, vocab_parallel_cross_entropy,
                                    vocab_parallel_linear_cross_entropy)
from mpzero.tensor_parallel import convert_to_fp8  # FP8 (fp8.py): the layers' linears


class TransformerLayer(nn.Module):
    """x + drop(attn(norm1(x))), then + drop(mlp(norm2(.))), its parts given (`transformer_layer` builds them from
    a config: LayerNorm or RMSNorm, GELU or SwiGLU MLP, RoPE or none in the attention); hidden dropout is
    replicated across TP (sequence parallel: x, the norms, dropouts and residual adds are this rank's slice of the
    sequence). The parts' attribute names are the parameters' names in checkpoints."""

    def __init__(self, input_layernorm: nn.Module, attention: nn.Module, post_attention_layernorm: nn.Module,
                 mlp: nn.Module, dropout: nn.Module):
        super().__init__()
        self.input_layernorm, self.attention = input_layernorm, attention
        self.post_attention_layernorm, self.mlp, self.dropout = post_attention_layernorm, mlp, dropout

    def forward(self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                start: int = 0) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.input_layernorm(x), cache, start))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


def transformer_layer(config: GPTConfig, tp: CommGroup, rng: RNGStatesTracker | None,
                      rotary: RotaryEmbedding | None = None, context: ContextParallel | None = None,
                      layer: int = 0, experts: ExpertGrid | None = None) -> TransformerLayer:
    """The layer the config describes (layer `layer`: a mixture of experts where --moe-layer-freq says, over the
    `experts` grid). Output projections (attention's dense, the MLP's fc2) start at std / sqrt(2 L), GPT-2's
    scaled residual init."""
    sp_group = tp if config.sequence_parallel else None
    std, h = config.init_method_std, config.hidden_size
    init, output_init = normal_init(std), normal_init(std / math.sqrt(2 * config.num_layers))
    norm_args = (config.normalization, h, config.layernorm_epsilon, config.layernorm_impl, sp_group)
    attention = AttentionConfig(h, config.num_attention_heads, config.query_groups, bias=config.add_bias_linear,
                                sequence_parallel=config.sequence_parallel, dropout=config.attention_dropout,
                                backend=config.attention_backend_name, softmax_impl=config.softmax_impl,
                                selective=config.granularity == "selective", kv_channels=config.kv_channels,
                                qk_norm=((config.normalization, config.layernorm_epsilon, config.layernorm_impl)
                                         if config.qk_layernorm else None))
    activation = F.silu if config.swiglu else gelu_tanh if config.openai_gelu else gelu
    if config.is_moe_layer(layer):
        mlp = moe_block(config, layer, tp, experts, init, output_init, activation)
    else:
        mlp = MLP(h, config.ffn_size, tp, init, output_init, activation=activation, gated=config.swiglu,
                  bias=config.add_bias_linear, sequence_parallel=config.sequence_parallel)
    return TransformerLayer(norm(*norm_args), SelfAttention(attention, tp, init, output_init, rng, rotary, context),
                            norm(*norm_args), mlp, HiddenDropout(config.hidden_dropout, rng, config.sequence_parallel))


class GPTEmbedding(nn.Module):
    """Vocab-parallel token embedding plus replicated learned positions (none with RoPE). Padding rows of the table
    start (and, receiving no gradient, stay) at zero. Under sequence parallelism the sum (all-reduced over
    the vocabulary shards) is cut to this rank's sequence slice before the dropout, as in Megatron."""

    def __init__(self, vocab_size: int, padded_vocab_size: int, hidden_size: int, positions: int | None,
                 init_std: float, dropout: float, tp: CommGroup, rng: RNGStatesTracker | None = None,
                 sequence_parallel: bool = False, context: ContextParallel | None = None):
        """`positions`: the learned position table's rows, None without one (RoPE, or no positions). `context`:
        the tokens are a context-parallel rank's, at its layout's global positions."""
        super().__init__()
        self.tp, self.sequence_parallel, self.context = tp, sequence_parallel, context
        self.word_embeddings = VocabParallelEmbedding(padded_vocab_size, hidden_size, tp,
                                                      vocab_rows_init(init_std, vocab_size))
        mark_tensor_parallel(self.word_embeddings.weight, 0, unpadded_size=vocab_size)
        self.position_embeddings = None
        if positions is not None:
            # a deferred weight like every other (given a weight, nn.Embedding skips its own reset_parameters, a
            # draw from the global RNG), so a GPU run starts where a CPU run does
            shape = (positions, hidden_size)
            self.position_embeddings = nn.Embedding(*shape, _weight=torch.empty(shape, device="meta"))
            self.position_embeddings.weight = mark_tensor_parallel(deferred_parameter(shape, normal_init(init_std)),
                                                                   None)
        self.dropout = HiddenDropout(dropout, rng, sequence_parallel)

    def forward(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        x = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            if self.context is not None:
                positions = self.context.layout(tokens.size(1)).positions(tokens.device)
            else:
                positions = torch.arange(start, start + tokens.size(1), device=tokens.device)
            x = x + self.position_embeddings(positions)
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel(x, self.tp)
        return self.dropout(x)


REDUCTIONS = ("none", "mean")


def _run_chunk(layers, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def _run_trunk(model: GPTModel, x: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """Embedding (where the chunk begins the model), the chunk's layers, final norm (where it ends the model)."""
    stage = model.stage
    x = model.embedding(x) if stage.begins(chunk) else x
    x = _run_chunk(model.layers[stage.positions(chunk)], x)
    return model.final_layernorm(x) if stage.ends(chunk) else x


class GPTModel(nn.Module):
    """`rng`: the dropout streams (`seed_everything`); may be None when the config has no dropout and no
    recomputation. `tp`: the tensor-parallel group (`init_parallel(...).tp`). `stage`: the part of the model to
    build (`ModelStage`: a pipeline rank's layers by chunk; default the whole model). A stage that ends the model
    but does not begin it, with the output layer tied to the embedding, holds its own copy of the word embedding
    under the same name (Megatron's): its gradient is added to the first stage's before the step
    (`mpzero.zero`'s `pipeline_copy` mark), so both copies stay equal and the norm counts one. `cp`: the
    context-parallel group (`init_parallel(...).cp`, of `config.context_parallel_size` ranks): the model then takes
    each rank's part of the sequence (`mpzero.context_parallel.split_batch`) and returns the losses of those
    tokens; None: whole sequences (inference, or a model built for its shapes). `ep`, `expert_tp`: the
    expert-parallel and expert-TP groups of a mixture of experts (default: one rank, and the TP group);
    `moe_metrics` is then their layers' shared record (mpzero.moe)."""

    def __init__(self, config: GPTConfig, tp: CommGroup, rng: RNGStatesTracker | None = None, device=None,
                 stage: ModelStage | None = None, cp: CommGroup | None = None, ep: CommGroup | None = None,
                 expert_tp: CommGroup | None = None):
        super().__init__()
        stage = stage or ModelStage.whole(config.num_layers)
        config.validate(tp.size)
        ep, expert_tp = ep or CommGroup(None, (0,), 0), expert_tp or tp
        check_expert_grid(config, ep.size, expert_tp.size)
        self.moe_metrics = None
        if config.num_experts:
            self.moe_metrics = MoEMetrics([config.is_moe_layer(i) for i in range(config.num_layers)],
                                          config.num_experts, config.sequence_parallel and tp.size > 1,
                                          config.moe_router_bias_update_rate, config.moe_token_dispatcher_type)
        self.expert_grid = grid = ExpertGrid(ep, expert_tp, self.moe_metrics, cp)  # its sizes: the activation formula
        if cp is not None and cp.size != config.context_parallel_size:
            raise ConfigError(f"the model's --context-parallel-size is {config.context_parallel_size} and its CP "
                              f"group has {cp.size} rank(s): build it with the run's groups.cp")
        self.context = ContextParallel(cp, config.cp_comm_type) if cp is not None and cp.size > 1 else None
        if rng is None and config.needs_rng:
            raise ConfigError(f"GPTModel needs an RNG tracker (rng=seed_everything(seed, tp_rank, device)) for "
                              f"hidden dropout {config.hidden_dropout}, attention dropout {config.attention_dropout}"
                              f" or recomputation {config.granularity}: pass one, or set both dropouts "
                              f"to 0 and no recomputation")
        self.config, self.tp, self.rng, self.stage = config, tp, rng, stage
        tied = not config.untie_embeddings_and_output_weights
        self.embedding = self.final_layernorm = self.output_layer = None
        if stage.first or (stage.last and tied):  # the last stage's copy: the word embedding alone
            # (with tied output weights and more than one stage)
            self.embedding = GPTEmbedding(
                config.vocab_size, config.padded_vocab_size(tp.size), config.hidden_size,
                config.max_position_embeddings if config.learned_positions and stage.first else None,
                config.init_method_std, config.hidden_dropout, tp, rng, config.sequence_parallel, self.context)
            if tied and stage.first != stage.last:  # tied across pipeline stages
                mark_pipeline_tied(self.embedding.word_embeddings.weight, copy=not stage.first)
        self.rotary = None
        if config.position_embedding_type == "rope":  # tables on the host, moved to the activations' device
            self.rotary = RotaryEmbedding(config.max_position_embeddings, config.rotary_dim, config.rotary_base)
        self.layers = LayerStack({i: transformer_layer(config, tp, rng, self.rotary, self.context, i, grid)
                                  for chunk in stage.chunks for i in chunk})
        if stage.last:
            self.final_layernorm = norm(config.normalization, config.hidden_size, config.layernorm_epsilon,
                                        config.layernorm_impl, tp if config.sequence_parallel else None)
        self._compiled_trunk = None
        if config.torch_compile:
            compile_layers(self.layers)
            if trunk_compilable(config, tp.size):  # the layers' compiled forwards are inlined into it
                self._compiled_trunk = compile_trunk(partial(_run_trunk, self), config.cuda_graph_impl)
                self._trunk_modules = [m for top in (self.embedding, self.layers, self.final_layernorm)
                                       if top is not None for m in top.modules()]
        if stage.last and config.untie_embeddings_and_output_weights:  # Megatron's output_layer: column-parallel
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, config.padded_vocab_size(tp.size), tp,
                vocab_rows_init(config.init_method_std, config.vocab_size), bias=False,
                sequence_parallel=config.sequence_parallel)
            mark_tensor_parallel(self.output_layer.weight, 0, unpadded_size=config.vocab_size)
        if config.fp8 is not None:  # the layers' linears (never the output layer), as torchao's filters choose
            self.fp8_linears = convert_to_fp8(self, config.fp8, config.bf16_layers())
        name_parameters(self, config.init_seed)
        if torch.device(device if device is not None else "cpu").type != "meta":
            materialize_module(self, device)  # the whole build; on the meta device ZeroOptimizer streams it

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None, reduction: str = "none",
                cache: KVCache | None = None, chunk: int = 0) -> torch.Tensor:
        """tokens [b, s] -> with labels: per-token losses [b, s] (`reduction="none"`, for a loss mask) or their
        mean (`reduction="mean"`); without labels: this rank's logits [b, s, V/tp]. With a `cache` (inference,
        `mpzero.models.KVCache`): tokens at positions [cache.length, cache.length + s), appended to the cache,
        -> this rank's logits of the last position [b, 1, V/tp] (nanoGPT's inference forward).
        A pipeline stage runs its model chunk `chunk`: it takes the previous stage's hidden states [b, s, h]
        (sequence parallel: [b, s/tp, h]) in place of tokens unless the chunk begins the model, and returns its
        own unless the chunk ends it."""
        if cache is not None:
            return self._forward_cached(tokens, cache)
        if reduction not in REDUCTIONS:
            raise ConfigError(f"reduction {reduction!r} is not one of {', '.join(REDUCTIONS)}")
        if self.stage.begins(chunk):
            self._check_tokens(tokens)
        x = self._trunk(tokens, chunk)  # sequence parallel: this rank's slice [b, s/tp, h]
        if not self.stage.ends(chunk):
            return x
        chunk = self.config.cross_entropy_chunk_size
        if labels is not None and chunk:  # the output projection fused with the loss: no [b, s, V/tp] logits
            weight = self.embedding.word_embeddings.weight if self.output_layer is None else self.output_layer.weight
            losses = vocab_parallel_linear_cross_entropy(x, weight, labels, self.tp, self.config.vocab_size, chunk,
                                                         self.config.sequence_parallel, self.config.cross_entropy_impl)
            return losses.mean() if reduction == "mean" else losses
        if self.output_layer is None:  # tied output projection, [b, s, V/tp]
            weight = self.embedding.word_embeddings.weight
            if self.config.sequence_parallel:
                logits = linear_with_sequence_gather(x, weight, None, self.tp)
            else:
                logits = F.linear(copy_to_tp(x, self.tp), weight)
        else:
            logits = self.output_layer(x)
        logits = self._mask_vocab_padding(logits)
        if labels is None:
            return logits
        losses = vocab_parallel_cross_entropy(logits, labels, self.tp)
        return losses.mean() if reduction == "mean" else losses

    def _check_tokens(self, tokens: torch.Tensor) -> None:
        """tokens: this CP rank's part of the sequence (all of it at CP 1)."""
        if tokens.size(1) * self.config.context_parallel_size > self.config.max_position_embeddings:
            raise ConfigError(f"sequence length {tokens.size(1) * self.config.context_parallel_size} exceeds "
                              f"--max-position-embeddings {self.config.max_position_embeddings}")
        if self.config.sequence_parallel and tokens.size(1) % self.tp.size:
            raise ConfigError(f"--sequence-parallel: sequence length {tokens.size(1)} (per CP rank) is not "
                              f"divisible by --tensor-model-parallel-size {self.tp.size}")

    def _forward_cached(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        if not self.stage.is_whole:
            raise ConfigError("a KV cache (generation) runs the whole model: build it without a pipeline stage")
        start, s = cache.length, tokens.size(1)
        if start + s > self.config.max_position_embeddings:
            raise ConfigError(f"position {start + s} exceeds --max-position-embeddings "
                              f"{self.config.max_position_embeddings}")
        if self.config.sequence_parallel or self.context is not None:
            raise ConfigError("a KV cache needs the model without --sequence-parallel or --context-parallel-size "
                              "(inference holds whole sequences)")
        x = self.embedding(tokens, start)  # learned positions from `start` (RoPE: in the attention)
        for i, layer in enumerate(self.layers):
            x = layer(x, cache.layer(i), start)
        cache.length += s
        x = self.final_layernorm(x[:, -1:])  # only the last position's logits are needed
        if self.output_layer is None:
            logits = F.linear(copy_to_tp(x, self.tp), self.embedding.word_embeddings.weight)
        else:
            logits = self.output_layer(x)
        return self._mask_vocab_padding(logits)

    def _trunk(self, x: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        """Embedding, the chunk's layers, final norm (each where the stage has it): one compiled region where
        `trunk_compilable` and no module in it has forward hooks (ZeRO-3's, for any unit), else module by
        module."""
        compiled = self._compiled_trunk is not None
        if compiled and not has_module_hooks(self._trunk_modules):
            if self.rotary is not None:
                self.rotary.follow(x.device)
            with activation_region(COMPILED_TRUNK):
                return self._compiled_trunk(x, chunk)
        if compiled and self.config.cuda_graph_impl != "none":
            raise ConfigError("--cuda-graph-impl local captures the trunk as one compiled region, but its modules "
                              "have forward hooks (ZeRO-3's gather and release) that must run around each: use "
                              "--zero-stage 0-2 or drop --cuda-graph-impl local")
        x = self.embedding(x) if self.stage.begins(chunk) else x
        x = self._layers(x, chunk)
        return self.final_layernorm(x) if self.stage.ends(chunk) else x

    def _layers(self, x: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        """The transformer layers, each in its activation-counting region (`mpzero.activations`), with full
        recomputation as configured: uniform N cuts the layers into chunks of N and keeps each chunk's input;
        block N recomputes the first N layers one by one and stores the rest (Megatron's per-stage rule: the
        first N of this model chunk). The host tier keeps the checkpoints (full) or every tensor the layers save in
        host memory, through torch.autograd.graph.save_on_cpu. Regions are numbered by the layers' global index."""
        config, layers = self.config, self.layers[self.stage.positions(chunk)]
        first = self.stage.chunks[chunk][0] if layers else 0
        full = config.granularity == "full" and self.training
        method, n = config.resolved_recompute_method, config.resolved_recompute_num_layers
        distribute = self.tp if config.distribute_saved_activations else None
        host = config.offload_activations == "cpu" and self.training
        i = 0
        while i < len(layers):
            if full and (method == "uniform" or i < n):
                end = min(i + n, len(layers)) if method == "uniform" else i + 1
                with activation_region(first + i), host_offload(host):
                    x = recompute(partial(_run_chunk, layers[i:end]), self.rng, x, distribute=distribute)
                i = end
            else:
                with activation_region(first + i), host_offload(host and not full):
                    x = layers[i](x)
                i += 1
        return x

    def activation_setting(self, micro_batch_size: int, seq_length: int, dtype: torch.dtype,
                           device: torch.device) -> ActivationSetting:
        """What `mpzero.activations.formula` needs for this model's activation bytes on this rank (its stage)."""
        setting = self.config.activation_setting(self.tp.size, micro_batch_size, seq_length, dtype, device,
                                                 tp_rank=self.tp.rank,
                                                 rng_streams=len(self.rng.states) if self.rng is not None else 1)
        grid = self.expert_grid
        grouped = experts_impl(self.config.moe_grouped_gemm) == "grouped_mm"
        setting = dataclasses.replace(setting, moe=moe_shape(self.config, grid.ep.size, grid.etp.size, grouped))
        return setting.for_stage(self.stage.chunks, self.stage.first, self.stage.last)

    def compiled_backward_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients one compiled backward delivers together (the trunk's, where it is one
        compiled region): ZeroOptimizer writes them into its buffers bucket by bucket (zero/collector.py)."""
        if self._compiled_trunk is None:
            return []
        return [p for module in self._trunk_modules for p in module.parameters(recurse=False)]

    def _mask_vocab_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """Padding ids get -inf logits, so the padded vocabulary never changes the loss."""
        local_vocab = logits.size(-1)
        first_padding = self.config.vocab_size - self.tp.rank * local_vocab
        if first_padding >= local_vocab:
            return logits
        padding = torch.arange(local_vocab, device=logits.device) >= first_padding
        return logits.masked_fill(padding, float("-inf"))
