"""GPT-2 (and the LLaMA family) built from the tensor-parallel layers.

Learned positions, pre-LayerNorm blocks, causal self-attention with heads split across the TP group,
GELU MLP of width 4h (erf, or tanh with `openai_gelu`), final LayerNorm, output projection tied to the
vocab-parallel input embedding (or its own column-parallel weight with `untie_embeddings_and_output_weights`).
Activations are [batch, seq, hidden]. The model knows TP (it takes `groups.tp`) but not ZeRO.

The LLaMA family is the same transformer with other parts, chosen by the config with Megatron's flags:
RMSNorm (`models/norms.py`), a SwiGLU MLP whose [gate; up] weight is split so each TP rank holds matching
halves (`models/swiglu.py`), RoPE in HF's rotate-half convention (`models/rotary.py`), grouped-query attention
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

import math
import contextlib
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from mpzero.activations import ActivationSetting, activation_region, host_offload
from mpzero.activations.formula import CPU_RNG_STATE_BYTES, CUDA_RNG_STATE_BYTES
from mpzero.comm import CommGroup
from mpzero.deferred_init import deferred_parameter, materialize_module, name_parameters
from mpzero.errors import ConfigError
from mpzero.fused import layer_norm, scaled_masked_softmax
from mpzero.fused.impl import (ATTENTION_BACKENDS, planned_attention_backend, planned_impl,
                               resolve_attention_backend)
from mpzero.models.kv_cache import KVCache
from mpzero.models.norms import RMSNorm
from mpzero.models.rotary import RotaryEmbedding
from mpzero.models.swiglu import SwiGLUMLP
from mpzero.tensor_parallel import (ColumnParallelLinear, RNGStatesTracker, RowParallelLinear,
                                    VocabParallelEmbedding, copy_to_tp, mark_tensor_parallel, recompute,
                                    vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy)
from mpzero.tensor_parallel.layers import linear_with_sequence_gather, ones_, zeros_
from mpzero.tensor_parallel.mappings import scatter_to_sequence_parallel


NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")


@dataclass(frozen=True)
class GPTConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    max_position_embeddings: int
    hidden_dropout: float = 0.1  # Megatron's defaults, as the flags' (--hidden-dropout, --attention-dropout)
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    make_vocab_size_divisible_by: int = 128
    recompute_activations: bool = False  # Megatron's flag: selective recomputation (= recompute_granularity "selective")
    recompute_granularity: str | None = None  # "selective" (the core attention) or "full" (whole layers)
    recompute_method: str | None = None  # full: "uniform" (chunks of N layers; the default) or "block" (first N)
    recompute_num_layers: int | None = None  # full: N (default 1: every layer recomputed on its own)
    distribute_saved_activations: bool = False  # full, TP > 1: each checkpoint kept as a 1/t slice (ZeRO-R Pa)
    sequence_parallel: bool = False  # TP > 1: LayerNorms, dropouts, residuals on a 1/t slice of the sequence
    offload_activations: str = "none"  # "cpu": checkpoints (full) or the layers' saved tensors in host memory
    layernorm_impl: str = "auto"  # mpzero.fused implementations; --no-layernorm-fusion gives "torch"
    softmax_impl: str = "auto"  # --no-masked-softmax-fusion gives "torch"
    use_flash_attn: bool = False  # --use-flash-attn: Megatron's older spelling of attention_backend "flash"
    attention_backend: str = "auto"  # --attention-backend: flash, fused, unfused, local (mpzero.fused.impl)
    torch_compile: bool = False  # --torch-compile: each TransformerLayer's forward through torch.compile
    seq_length: int | None = None  # the training sequence length (FLOPs count); None: max_position_embeddings
    untie_embeddings_and_output_weights: bool = False  # --untie-embeddings-and-output-weights: own output weight
    openai_gelu: bool = False  # --openai-gelu: GELU's tanh approximation (GPT-2's), instead of the exact erf form
    init_seed: int = 1234  # seeds the model's own initialization generator (pretrain_gpt.py: --seed)
    cross_entropy_chunk_size: int = 2048  # --cross-entropy-chunk-size: projection + loss per N tokens; 0: logits
    # The LLaMA family's choices, Megatron's flags with Megatron's meanings (GPT-2's values by default):
    normalization: str = "LayerNorm"  # --normalization: LayerNorm or RMSNorm (no bias; eps is --norm-epsilon)
    swiglu: bool = False  # --swiglu: MLP down(silu(gate(x)) * up(x)) instead of fc2(gelu(fc1(x)))
    ffn_hidden_size: int | None = None  # --ffn-hidden-size; None: 4h, or with --swiglu int(8h/3 / 64) * 64
    position_embedding_type: str = "learned_absolute"  # --position-embedding-type: learned_absolute, rope or none
    add_position_embedding: bool = True  # False: --no-position-embedding (no learned absolute positions)
    rotary_base: float = 10000.0  # --rotary-base: RoPE's theta (Llama 2: 10000, Llama 3: 500000)
    rotary_percent: float = 1.0  # --rotary-percent: the share of each head's features rotated
    group_query_attention: bool = False  # --group-query-attention: K/V heads shared by groups of query heads
    num_query_groups: int | None = None  # --num-query-groups: K/V heads with --group-query-attention (default 1)
    add_bias_linear: bool = True  # False: --disable-bias-linear (no bias in QKV, projection and MLP linears)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """K/V heads: --num-query-groups under --group-query-attention (Megatron's default 1), else one per head."""
        return (self.num_query_groups or 1) if self.group_query_attention else self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        """The MLP's hidden width: --ffn-hidden-size, else Megatron's default (4h; 8h/3 rounded down to a
        multiple of 64 with --swiglu, the same parameter count as 4h with two matrices)."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.swiglu else 4 * self.hidden_size

    @property
    def learned_positions(self) -> bool:
        return self.position_embedding_type == "learned_absolute" and self.add_position_embedding

    @property
    def rotary_dim(self) -> int:
        """Features of each head that RoPE rotates (0 without rope)."""
        return int(self.head_dim * self.rotary_percent) if self.position_embedding_type == "rope" else 0

    @property
    def granularity(self) -> str | None:
        """The recomputation in effect: --recompute-activations is Megatron's selective recomputation."""
        return "selective" if self.recompute_activations else self.recompute_granularity

    @property
    def resolved_recompute_method(self) -> str | None:
        return (self.recompute_method or "uniform") if self.granularity == "full" else None

    @property
    def resolved_recompute_num_layers(self) -> int | None:
        return (self.recompute_num_layers or 1) if self.granularity == "full" else None

    def validate(self, tp_size: int) -> None:
        self._validate_activation_memory(tp_size)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"--attention-backend {self.attention_backend} is not one of "
                              f"{', '.join(ATTENTION_BACKENDS)}")
        if self.use_flash_attn and self.attention_backend not in ("auto", "flash"):
            raise ConfigError(f"--use-flash-attn means --attention-backend flash, but --attention-backend "
                              f"{self.attention_backend} was given too: keep one of them")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ConfigError(f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                              f"{self.num_attention_heads}: choose sizes whose ratio is the head size")
        if self.num_attention_heads % tp_size != 0:
            raise ConfigError(f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                              f"--tensor-model-parallel-size {tp_size}: each TP rank must own whole heads")
        for name in ("num_layers", "hidden_size", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"--{name.replace('_', '-')} must lie in [0, 1), got {getattr(self, name)}")
        self._validate_family(tp_size)

    def _validate_family(self, tp_size: int) -> None:
        """The LLaMA family's flags, each a one-line error (Megatron's rules where it has them)."""
        if self.normalization not in NORMALIZATIONS:
            raise ConfigError(f"--normalization {self.normalization} is not one of {', '.join(NORMALIZATIONS)}")
        if self.position_embedding_type not in POSITION_EMBEDDINGS:
            raise ConfigError(f"--position-embedding-type {self.position_embedding_type} is not one of "
                              f"{', '.join(POSITION_EMBEDDINGS)}")
        if self.ffn_size < 1 or self.ffn_size % tp_size:
            raise ConfigError(f"--ffn-hidden-size {self.ffn_size} must be positive and divisible by "
                              f"--tensor-model-parallel-size {tp_size}" + ("" if self.ffn_hidden_size else
                              " (it defaults to 4h, or int(8h/3 / 64) * 64 with --swiglu): give it explicitly"))
        if self.num_query_groups is not None and not self.group_query_attention:
            raise ConfigError(f"--num-query-groups {self.num_query_groups} needs --group-query-attention")
        groups, heads = self.query_groups, self.num_attention_heads
        if groups < 1 or heads % groups:
            raise ConfigError(f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups}: each "
                              f"key/value head serves a whole number of query heads")
        if groups % tp_size:
            raise ConfigError(f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size "
                              f"{tp_size}: each TP rank must own whole key/value groups")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ConfigError(f"--rotary-percent {self.rotary_percent} must lie in (0, 1]")
        if not self.rotary_base > 0:
            raise ConfigError(f"--rotary-base {self.rotary_base} must be positive")
        if self.position_embedding_type == "rope" and (self.rotary_dim < 2 or self.rotary_dim % 2):
            raise ConfigError(f"--rotary-percent {self.rotary_percent} of head size {self.head_dim} rotates "
                              f"{self.rotary_dim} features: RoPE needs an even number, at least 2")

    def _validate_activation_memory(self, tp_size: int) -> None:
        """Megatron's rules for the recomputation and sequence-parallel flags, each a one-line error."""
        g = self.recompute_granularity
        if g not in (None, "selective", "full"):
            raise ConfigError(f"--recompute-granularity {g} is not one of full, selective")
        if self.recompute_activations and g == "full":
            raise ConfigError("--recompute-activations is selective recomputation, but --recompute-granularity full "
                              "was given too: keep one of them")
        granularity = self.granularity
        if self.recompute_method not in (None, "uniform", "block"):
            raise ConfigError(f"--recompute-method {self.recompute_method} is not one of uniform, block")
        for flag, value in (("--recompute-method", self.recompute_method),
                            ("--recompute-num-layers", self.recompute_num_layers)):
            if value is not None and granularity != "full":
                raise ConfigError(f"{flag} {value} needs --recompute-granularity full (selective recomputation "
                                  f"recomputes the core attention of every layer)")
        n = self.recompute_num_layers
        if n is not None and not 1 <= n <= self.num_layers:
            raise ConfigError(f"--recompute-num-layers {n} is out of range: it must be between 1 and --num-layers "
                              f"{self.num_layers}")
        if self.sequence_parallel:
            if tp_size == 1:
                raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1: it splits the "
                                  "sequence across the TP group (Megatron turns it off at TP 1)")
            seq = self.seq_length or self.max_position_embeddings
            if seq % tp_size:
                raise ConfigError(f"--sequence-parallel: --seq-length {seq} is not divisible by "
                                  f"--tensor-model-parallel-size {tp_size}")
        if self.distribute_saved_activations:
            if tp_size == 1:
                raise ConfigError("--distribute-saved-activations needs --tensor-model-parallel-size > 1: it keeps "
                                  "each checkpoint as 1/t slices across the TP group")
            if granularity != "full":
                raise ConfigError("--distribute-saved-activations needs --recompute-granularity full: only full "
                                  "recomputation keeps checkpoints to distribute")
            if self.sequence_parallel:
                raise ConfigError("--distribute-saved-activations cannot be combined with --sequence-parallel (as in "
                                  "Megatron): the checkpoints are already 1/t slices of the sequence")
        if self.offload_activations not in ("none", "cpu"):
            raise ConfigError(f"--offload-activations {self.offload_activations} is not one of none, cpu")

    def attention(self, device: torch.device | str) -> str:
        """The attention backend this config runs on a device of `device`'s type: flash, fused, unfused or
        local (`mpzero.fused.impl.resolve_attention_backend`; --use-flash-attn is flash)."""
        return resolve_attention_backend(self._attention_backend, device)

    def planned_attention(self, device: torch.device | str) -> str:
        """`attention(device)` without its check that the backend can run there (a CPU machine plans a CUDA
        run)."""
        return planned_attention_backend(self._attention_backend, device)

    @property
    def _attention_backend(self) -> str:
        return "flash" if self.use_flash_attn else self.attention_backend

    @property
    def needs_rng(self) -> bool:
        """Dropout or recomputation draw from (or replay) an RNG tracker; without them none is needed."""
        return self.hidden_dropout > 0 or self.attention_dropout > 0 or self.granularity is not None

    def architecture(self) -> dict:
        """The settings that give the weights their meaning, by flag name: a checkpoint saved with other values
        is refused even where the tensor shapes agree (4 heads saved, 8 loaded: same QKV shape, other rows)."""
        names = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings",
                 "layernorm_epsilon", "untie_embeddings_and_output_weights", "openai_gelu", "normalization",
                 "swiglu", "rotary_base", "rotary_percent", "add_bias_linear")
        position = ("learned_absolute" if self.learned_positions
                    else "rope" if self.position_embedding_type == "rope" else "none")
        arch = {**{name: getattr(self, name) for name in names}, "ffn_hidden_size": self.ffn_size,
                "num_query_groups": self.query_groups, "position_embedding_type": position}
        if position != "rope":  # unused without RoPE: not part of what the weights mean
            arch["rotary_base"] = arch["rotary_percent"] = None
        return arch

    def flops_per_token(self, tp_size: int = 1) -> float:
        """Matmul FLOPs per trained token, forward and backward, as Megatron counts them
        (megatron/training/training.py, num_floating_point_operations, for GPT: 72 B s l h^2 (1 + s/(6h)
        + V/(12 l h)) per batch of B sequences of s tokens, V the padded vocabulary at this TP size).
        Per token and layer a forward is 24 h^2 (QKV 6h^2, projection 2h^2, MLP 16h^2) + 4 s h (scores and
        the weighted sum of values, over all s positions: the causal half is not subtracted); the logits add
        2 h V; backward is twice the forward. Full recomputation (`recompute_activations`) runs the layers'
        forward once more, not the logits': 96 l h^2 (1 + s/(6h)) + 6 h V (Narayanan et al. 2021's
        96 B s l h^2 (1 + s/(6h) + V/(16 l h)); Megatron's own printed figure leaves recomputation out); with
        --recompute-method block N only the first N layers are recomputed. Selective recomputation runs the
        core attention's two matmuls once more: + 4 l s h per token (what FlopCounterMode counts; Korthikanti et
        al.'s Appendix A writes selective's hardware FLOPs as 72 B s l h^2 (1 + s/(3h) + V/(12 l h)), + 12 l s h).
        The chunked cross entropy (`cross_entropy_chunk_size`) recomputes the logits in backward: + 2 h V.
        The LLaMA family's terms: QKV 2h(h + 2gd) for g query groups of head size d (K and V smaller), and the MLP
        2hf per matrix, three of them with SwiGLU (gate, up, down), for ffn width f."""
        l, h, s = self.num_layers, self.hidden_size, self.seq_length or self.max_position_embeddings
        vocab = self.padded_vocab_size(tp_size)
        # QKV 2h(h + 2 g d) (6h^2 without GQA), projection 2h^2, MLP 2 h f x 2 matrices (16h^2 at f = 4h) or 3
        # with SwiGLU (gate, up, down), attention 4sh; RoPE, norms and the activations are not matmuls
        qkv = 2 * h * (self.num_attention_heads + 2 * self.query_groups) * self.head_dim
        per_layer = qkv + 2 * h ** 2 + 2 * h * self.ffn_size * (3 if self.swiglu else 2) + 4 * s * h
        recomputed = 0
        if self.granularity == "full":
            n = self.resolved_recompute_num_layers
            recomputed = (l if self.resolved_recompute_method == "uniform" else n) * per_layer
        elif self.granularity == "selective":
            recomputed = l * 4 * s * h
        logits = (4 if self.cross_entropy_chunk_size else 3) * 2 * h * vocab
        return 3 * l * per_layer + recomputed + logits

    def activation_setting(self, tp_size: int, micro_batch_size: int, seq_length: int, dtype: torch.dtype,
                           device: torch.device | str = "cpu", tp_rank: int = 0,
                           rng_streams: int = 1) -> ActivationSetting:
        """The shape and modes `mpzero.activations.formula` needs for the activation bytes of TP rank `tp_rank`
        (only the vocabulary padding mask depends on it), with activations and parameters in `dtype`, on a
        device of `device`'s type (CPU dropout masks in the input dtype, CUDA's bool; RNG state sizes)."""
        device = torch.device(device)
        attention = self.planned_attention(device)
        return ActivationSetting(
            seq_length=seq_length, micro_batch_size=micro_batch_size, hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads, num_layers=self.num_layers, vocab_size=self.vocab_size,
            padded_vocab_size=self.padded_vocab_size(tp_size), tp=tp_size, tp_rank=tp_rank,
            dtype_bytes=dtype.itemsize, mask_bytes=1 if device.type == "cuda" else dtype.itemsize,
            hidden_dropout=self.hidden_dropout > 0, attention_dropout=self.attention_dropout > 0,
            sequence_parallel=self.sequence_parallel, recompute_granularity=self.granularity,
            recompute_method=self.resolved_recompute_method,
            recompute_num_layers=self.resolved_recompute_num_layers,
            distribute_saved_activations=self.distribute_saved_activations,
            offload_activations=self.offload_activations == "cpu",
            layernorm_impl=planned_impl("rms_norm" if self.normalization == "RMSNorm" else "layer_norm", device,
                                        self.layernorm_impl),
            softmax_impl=("torch" if attention == "unfused"
                          else planned_impl("scaled_masked_softmax", device, self.softmax_impl)),
            flash_attention=attention in ("flash", "fused"), compiled_layers=self.torch_compile,
            rng_state_bytes=CUDA_RNG_STATE_BYTES if device.type == "cuda" else CPU_RNG_STATE_BYTES,
            rng_streams=rng_streams, chunked_cross_entropy=self.cross_entropy_chunk_size > 0,
            ffn_hidden_size=self.ffn_size, num_query_groups=self.query_groups,
            rms_norm=self.normalization == "RMSNorm", swiglu=self.swiglu,
            rotary=self.position_embedding_type == "rope", learned_positions=self.learned_positions)

    def padded_vocab_size(self, tp_size: int) -> int:
        """Megatron's --make-vocab-size-divisible-by, times TP so every rank gets an equal shard."""
        multiple = self.make_vocab_size_divisible_by * tp_size
        return -(-self.vocab_size // multiple) * multiple


def _normal(std: float):
    def init(full: torch.Tensor, generator: torch.Generator) -> None:
        nn.init.normal_(full, mean=0.0, std=std, generator=generator)
    return init


def _vocab_rows(std: float, vocab: int):
    """Init of a [padded vocabulary, h] weight: only the real rows are drawn (the same draws whatever the padding
    and the TP size), the padding rows are zero (and, receiving no gradient, stay zero)."""
    def init(full: torch.Tensor, generator: torch.Generator) -> None:
        nn.init.normal_(full[:vocab], std=std, generator=generator)
        full[vocab:].zero_()
    return init


class LayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the hidden dimension (mpzero.fused.layer_norm);
    replicated across the TP group. Statistics, weight and bias are used in fp32 whatever the
    parameters' storage dtype (ZeRO stores them in bf16/fp16 under mixed precision). With `tp` given
    (sequence parallelism) it normalizes this rank's sequence slice, and the weight and bias gradients are
    all-reduced over the TP group on their way back (Megatron's allreduce of `sequence_parallel` grads)."""

    def __init__(self, config: GPTConfig, tp: CommGroup | None = None):
        super().__init__()
        self.eps, self.impl = config.layernorm_epsilon, config.layernorm_impl
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.weight = mark_tensor_parallel(deferred_parameter((config.hidden_size,), ones_), None)
        self.bias = mark_tensor_parallel(deferred_parameter((config.hidden_size,), zeros_), None)
        self.weight.sequence_parallel = self.bias.sequence_parallel = self.tp is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight.float(), self.bias.float()
        if self.tp is not None:
            weight, bias = copy_to_tp(weight, self.tp), copy_to_tp(bias, self.tp)
        return layer_norm(x, weight, bias, self.eps, impl=self.impl)


def norm(config: GPTConfig, tp: CommGroup | None = None) -> nn.Module:
    """The configured normalization (--normalization), replicated across TP; `tp` under sequence parallelism."""
    if config.normalization == "RMSNorm":
        return RMSNorm(config.hidden_size, config.layernorm_epsilon, config.layernorm_impl, tp)
    return LayerNorm(config, tp)


class SelfAttention(nn.Module):
    """Causal multi-head attention; this TP rank computes heads [r*n/tp, (r+1)*n/tp). Grouped-query attention
    (g key/value heads, each shared by n/g query heads): this rank holds groups [r*g/tp, (r+1)*g/tp) with their
    query heads. The fused QKV weight is laid out group by group ([g, (n/g q heads, k, v), head_dim] rows; head by
    head, [heads, (q,k,v), head_dim], without GQA), so a contiguous column-parallel split hands each rank whole
    groups. RoPE (`rotary`, shared by the model's layers) rotates q and k per rank. The core attention runs on the
    configured backend (`GPTConfig.attention`: torch's scaled_dot_product_attention for flash and fused,
    explicit [s, s] scores for local and unfused), resolved for the device of its input. Selective recomputation
    keeps the QKV output (q, k and v are its views) and recomputes the core attention in backward, its dropout
    masks replayed from the saved RNG states. With flash attention it still does so when asked, although flash
    keeps no [s, s] tensor (Megatron calls selective recomputation unnecessary there): it then saves only the
    kernel's fp32 logsumexp, at the cost of one more attention forward."""

    def __init__(self, config: GPTConfig, tp: CommGroup, rng: RNGStatesTracker | None,
                 rotary: RotaryEmbedding | None = None):
        super().__init__()
        h, std = config.hidden_size, config.init_method_std
        self.head_dim = config.head_dim
        self.local_heads = config.num_attention_heads // tp.size
        self.local_groups = config.query_groups // tp.size
        self.rng, self.dropout, self.softmax_impl = rng, config.attention_dropout, config.softmax_impl
        self.config, self.rotary = config, rotary
        self.selective = config.granularity == "selective"
        sp, bias = config.sequence_parallel, config.add_bias_linear
        width = (config.num_attention_heads + 2 * config.query_groups) * self.head_dim  # 3h without GQA
        self.qkv = ColumnParallelLinear(h, width, tp, _normal(std), bias=bias, sequence_parallel=sp)
        self.dense = RowParallelLinear(h, h, tp, _normal(std / math.sqrt(2 * config.num_layers)), bias=bias,
                                       sequence_parallel=sp)

    def backend(self, device: torch.device) -> str:
        """flash, fused, unfused or local: the core attention this module runs on `device`."""
        return self.config.attention(device)

    def forward(self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                start: int = 0) -> torch.Tensor:
        """x [b, s(/tp), h] -> [b, s(/tp), h]. With `cache` (this layer's keys and values, `KVCache.layer`):
        inference at positions [start, start + s), the new keys and values appended, attention over all."""
        qkv = self.qkv(x)  # [b, s, 3h/tp]: the whole sequence, also when x is a sequence-parallel slice
        b, s = qkv.shape[:2]
        dropout = self.dropout if self.training else 0.0
        if cache is not None:
            context = self._cached_attention(qkv, *cache, start)
        elif self.selective and self.training:  # keeps qkv itself (whose views q, k, v are), not copies
            context = recompute(partial(self._core_attention, dropout=dropout), self.rng, qkv)
        else:
            context = self._core_attention(qkv, dropout)
        return self.dense(context.transpose(1, 2).reshape(b, s, -1))  # [b, s, h/tp] in, [b, s(/tp), h] out

    def split_heads(self, qkv: torch.Tensor, start: int = 0):
        """qkv [b, s, local width] at positions [start, start + s) -> q [b, local_heads, s, head_dim] and k, v
        [b, local_groups, s, head_dim], RoPE applied to q and k. The rows are laid out group by group, each group
        its query heads then its key and its value head (Megatron's GQA layout; [heads, (q, k, v), head_dim]
        without GQA), so a contiguous column-parallel split hands each rank whole groups."""
        b, s = qkv.shape[:2]
        per_group = self.local_heads // self.local_groups
        x = qkv.view(b, s, self.local_groups, per_group + 2, self.head_dim)
        # query head i uses group i // per_group; q stays laid out [b, s, heads, hd] (a view of qkv with one
        # group per rank, else a copy) like k and v, so attention's output is too and the projection reads a view
        q = x[:, :, :, :per_group].reshape(b, s, self.local_heads, self.head_dim).transpose(1, 2)
        k, v = x[:, :, :, per_group].transpose(1, 2), x[:, :, :, per_group + 1].transpose(1, 2)
        if self.rotary is not None:
            q, k = self.rotary.rotate(q, k, start)  # a method, not a module call: no hooks inside a replay
        return q, k, v

    def _cached_attention(self, qkv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          start: int) -> torch.Tensor:
        """The core attention of positions [start, start + s) over the cached keys and values before them and
        their own (written into the cache): query i (position start + i) sees keys [0, start + i]."""
        q, k, v = self.split_heads(qkv, start)  # q [b, heads, s, d]; k, v [b, groups, s, d]
        s = q.size(2)
        keys[:, :, start:start + s], values[:, :, start:start + s] = k, v
        backend = self.backend(qkv.device)
        if start == 0:  # the prompt: the model's own causal attention
            return self.attend(q, k, v, 0.0, backend)
        k, v = keys[:, :, :start + s], values[:, :, :start + s]
        future = None  # one new position sees every key
        if s > 1:
            future = torch.arange(start + s, device=q.device) > torch.arange(start, start + s, device=q.device)[:, None]
        if backend in ("flash", "fused"):  # any SDPA kernel: cuDNN's needs no mask of its own here
            return F.scaled_dot_product_attention(q, k, v, attn_mask=None if future is None else ~future,
                                                  enable_gqa=k.size(1) != q.size(1))
        if k.size(1) != q.size(1):  # each group's keys and values for each of its query heads
            k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
        scores = torch.matmul(q, k.transpose(-1, -2))  # [b, local_heads, s, start + s]
        probs = scaled_masked_softmax(scores, 1.0 / math.sqrt(self.head_dim), causal=False, mask=future,
                                      impl="torch" if backend == "unfused" else self.softmax_impl)
        return torch.matmul(probs, v)

    def _core_attention(self, qkv: torch.Tensor, dropout: float) -> torch.Tensor:
        q, k, v = self.split_heads(qkv)
        # heads differ across TP ranks, so must their dropout masks (no dropout: nothing drawn, no RNG state
        # swapped, which torch.compile would have to break around)
        with self.rng.fork() if self.rng is not None and dropout > 0 else contextlib.nullcontext():
            return self.attend(q, k, v, dropout, self.backend(qkv.device))

    def attend(self, q, k, v, dropout: float, backend: str) -> torch.Tensor:
        """Causal attention of q [b, local_heads, s, head_dim] over k, v [b, local_groups, s, head_dim] on
        `backend` (GQA: SDPA's enable_gqa on flash; the local path repeats each group's k, v for its heads)."""
        if k.size(1) != q.size(1) and backend not in ("flash", "fused"):
            k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
        if backend == "flash":
            return self._flash(q, k, v, dropout)
        if backend == "fused":
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return self._flash(q, k, v, dropout)
        return self._core(q, k, v, dropout, "torch" if backend == "unfused" else self.softmax_impl)

    def _core(self, q, k, v, dropout: float, softmax_impl: str) -> torch.Tensor:
        """Megatron's core attention: explicit scores, fused scale + causal mask + softmax, dropout."""
        scores = torch.matmul(q, k.transpose(-1, -2))  # [b, local_heads, s, s]
        probs = scaled_masked_softmax(scores, 1.0 / math.sqrt(self.head_dim), causal=True, impl=softmax_impl)
        return torch.matmul(F.dropout(probs, dropout) if dropout > 0 else probs, v)  # [b, local_heads, s, hd]

    def _flash(self, q, k, v, dropout: float) -> torch.Tensor:
        """The same maths in one kernel that never materializes [s, s] (FlashAttention on GPUs)."""
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                              enable_gqa=k.size(1) != q.size(1))


class MLP(nn.Module):
    """h -> ffn (4h by default; column-parallel, GELU on this rank's shard) -> h (row-parallel, all-reduced)."""

    def __init__(self, config: GPTConfig, tp: CommGroup):
        super().__init__()
        h, std = config.hidden_size, config.init_method_std
        sp = config.sequence_parallel
        self.approximate = "tanh" if config.openai_gelu else "none"
        f, bias = config.ffn_size, config.add_bias_linear
        self.fc1 = ColumnParallelLinear(h, f, tp, _normal(std), bias=bias, sequence_parallel=sp)
        self.fc2 = RowParallelLinear(f, h, tp, _normal(std / math.sqrt(2 * config.num_layers)), bias=bias,
                                     sequence_parallel=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class _HiddenDropout(nn.Dropout):
    """Dropout on the hidden state: from the default generator (the same mask on every TP rank, which all hold
    the same activations) or, under sequence parallelism, from the tracker's tensor-parallel stream (each rank
    holds another slice of the sequence, as in Megatron)."""

    def __init__(self, p: float, rng: RNGStatesTracker | None, sequence_parallel: bool):
        super().__init__(p)
        self.rng, self.sequence_parallel = rng, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and self.training and self.p > 0:
            with self.rng.fork():
                return super().forward(x)
        return super().forward(x)


class TransformerLayer(nn.Module):
    """x + drop(attn(ln1(x))), then + drop(mlp(ln2(.))), its parts chosen by the config (LayerNorm or RMSNorm,
    GELU or SwiGLU MLP, RoPE or none in the attention); hidden dropout is replicated across TP
    (sequence parallel: x, the LayerNorms, dropouts and residual adds are this rank's slice of the sequence)."""

    def __init__(self, config: GPTConfig, tp: CommGroup, rng: RNGStatesTracker | None,
                 rotary: RotaryEmbedding | None = None):
        super().__init__()
        sp_group = tp if config.sequence_parallel else None
        self.input_layernorm = norm(config, sp_group)
        self.attention = SelfAttention(config, tp, rng, rotary)
        self.post_attention_layernorm = norm(config, sp_group)
        if config.swiglu:
            std = config.init_method_std
            self.mlp = SwiGLUMLP(config, tp, _normal(std), _normal(std / math.sqrt(2 * config.num_layers)))
        else:
            self.mlp = MLP(config, tp)
        self.dropout = _HiddenDropout(config.hidden_dropout, rng, config.sequence_parallel)

    def forward(self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                start: int = 0) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.input_layernorm(x), cache, start))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


class GPTEmbedding(nn.Module):
    """Vocab-parallel token embedding plus replicated learned positions (none with RoPE). Padding rows of the table
    start (and, receiving no gradient, stay) at zero. Under sequence parallelism the sum (all-reduced over
    the vocabulary shards) is cut to this rank's sequence slice before the dropout, as in Megatron."""

    def __init__(self, config: GPTConfig, tp: CommGroup, rng: RNGStatesTracker | None = None):
        super().__init__()
        std, vocab = config.init_method_std, config.vocab_size
        self.tp, self.sequence_parallel = tp, config.sequence_parallel
        self.word_embeddings = VocabParallelEmbedding(config.padded_vocab_size(tp.size), config.hidden_size,
                                                      tp, _vocab_rows(std, vocab))
        mark_tensor_parallel(self.word_embeddings.weight, 0, unpadded_size=vocab)
        self.position_embeddings = None  # RoPE (in the attention) or no positions
        if config.learned_positions:
            # a deferred weight like every other (given a weight, nn.Embedding skips its own reset_parameters, a
            # draw from the global RNG), so a GPU run starts where a CPU run does
            shape = (config.max_position_embeddings, config.hidden_size)
            self.position_embeddings = nn.Embedding(*shape, _weight=torch.empty(shape, device="meta"))
            self.position_embeddings.weight = mark_tensor_parallel(deferred_parameter(shape, _normal(std)), None)
        self.dropout = _HiddenDropout(config.hidden_dropout, rng, config.sequence_parallel)

    def forward(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        x = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(torch.arange(start, start + tokens.size(1), device=tokens.device))
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel(x, self.tp)
        return self.dropout(x)


REDUCTIONS = ("none", "mean")


def compile_layers(layers: nn.ModuleList) -> None:
    """torchtitan's regional compilation: each layer's `forward` goes through torch.compile, not the whole model
    and not the module call, so ZeRO-3's gather/release hooks, activation counting and full recomputation stay
    in eager Python around it and parameter names do not change. The layers share one compiled graph (same code,
    same shapes). Inside a layer, what dynamo cannot trace (the tensor-parallel collectives' custom autograd
    functions at TP > 1, the RNG tracker's fork for dropout and selective recomputation) runs eagerly between
    compiled pieces (graph breaks, not errors). Dropout in compiled code draws its masks from inductor's own
    generator: the same distribution, other masks than an eager run. The activation formula does not model
    what the compiled graphs save (the `activation memory` line says so)."""
    for layer in layers:
        layer.forward = torch.compile(layer.forward)


def _run_chunk(layers, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


class GPTModel(nn.Module):
    """`rng`: the dropout streams (`seed_everything`); may be None when the config has no dropout and no
    recomputation. `tp`: the tensor-parallel group (`init_parallel(...).tp`)."""

    def __init__(self, config: GPTConfig, tp: CommGroup, rng: RNGStatesTracker | None = None, device=None):
        super().__init__()
        config.validate(tp.size)
        if rng is None and config.needs_rng:
            raise ConfigError(f"GPTModel needs an RNG tracker (rng=seed_everything(seed, tp_rank, device)) for "
                              f"hidden dropout {config.hidden_dropout}, attention dropout {config.attention_dropout}"
                              f" or recomputation {config.granularity}: pass one, or set both dropouts "
                              f"to 0 and no recomputation")
        self.config, self.tp, self.rng = config, tp, rng
        self.embedding = GPTEmbedding(config, tp, rng)
        self.rotary = None
        if config.position_embedding_type == "rope":  # tables on the host, moved to the activations' device
            self.rotary = RotaryEmbedding(config.max_position_embeddings, config.rotary_dim, config.rotary_base)
        self.layers = nn.ModuleList(TransformerLayer(config, tp, rng, self.rotary) for _ in range(config.num_layers))
        if config.torch_compile:
            compile_layers(self.layers)
        self.final_layernorm = norm(config, tp if config.sequence_parallel else None)
        self.output_layer = None
        if config.untie_embeddings_and_output_weights:  # Megatron's output_layer: column-parallel, no bias
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, config.padded_vocab_size(tp.size), tp,
                _vocab_rows(config.init_method_std, config.vocab_size), bias=False,
                sequence_parallel=config.sequence_parallel)
            mark_tensor_parallel(self.output_layer.weight, 0, unpadded_size=config.vocab_size)
        name_parameters(self, config.init_seed)
        if torch.device(device if device is not None else "cpu").type != "meta":
            materialize_module(self, device)  # the whole build; on the meta device ZeroOptimizer streams it

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None, reduction: str = "none",
                cache: KVCache | None = None) -> torch.Tensor:
        """tokens [b, s] -> with labels: per-token losses [b, s] (`reduction="none"`, for a loss mask) or their
        mean (`reduction="mean"`); without labels: this rank's logits [b, s, V/tp]. With a `cache` (inference,
        `mpzero.models.KVCache`): tokens at positions [cache.length, cache.length + s), appended to the cache,
        -> this rank's logits of the last position [b, 1, V/tp] (nanoGPT's inference forward)."""
        if cache is not None:
            return self._forward_cached(tokens, cache)
        if reduction not in REDUCTIONS:
            raise ConfigError(f"reduction {reduction!r} is not one of {', '.join(REDUCTIONS)}")
        if tokens.size(1) > self.config.max_position_embeddings:
            raise ConfigError(f"sequence length {tokens.size(1)} exceeds --max-position-embeddings "
                              f"{self.config.max_position_embeddings}")
        if self.config.sequence_parallel and tokens.size(1) % self.tp.size:
            raise ConfigError(f"--sequence-parallel: sequence length {tokens.size(1)} is not divisible by "
                              f"--tensor-model-parallel-size {self.tp.size}")
        x = self._layers(self.embedding(tokens))  # sequence parallel: this rank's slice [b, s/tp, h]
        x = self.final_layernorm(x)
        chunk = self.config.cross_entropy_chunk_size
        if labels is not None and chunk:  # the output projection fused with the loss: no [b, s, V/tp] logits
            weight = self.embedding.word_embeddings.weight if self.output_layer is None else self.output_layer.weight
            losses = vocab_parallel_linear_cross_entropy(x, weight, labels, self.tp, self.config.vocab_size, chunk,
                                                         self.config.sequence_parallel)
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

    def _forward_cached(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        start, s = cache.length, tokens.size(1)
        if start + s > self.config.max_position_embeddings:
            raise ConfigError(f"position {start + s} exceeds --max-position-embeddings "
                              f"{self.config.max_position_embeddings}")
        if self.config.sequence_parallel:
            raise ConfigError("a KV cache needs the model without --sequence-parallel (inference holds whole "
                              "sequences)")
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

    def _layers(self, x: torch.Tensor) -> torch.Tensor:
        """The transformer layers, each in its activation-counting region (`mpzero.activations`), with full
        recomputation as configured: uniform N cuts the layers into chunks of N and keeps each chunk's input;
        block N recomputes the first N layers one by one and stores the rest (Megatron's per-stage rule; one
        stage here). The host tier keeps the checkpoints (full) or every tensor the layers save in host
        memory, through torch.autograd.graph.save_on_cpu."""
        config, layers = self.config, self.layers
        full = config.granularity == "full" and self.training
        method, n = config.resolved_recompute_method, config.resolved_recompute_num_layers
        distribute = self.tp if config.distribute_saved_activations else None
        host = config.offload_activations == "cpu" and self.training
        i = 0
        while i < len(layers):
            if full and (method == "uniform" or i < n):
                end = min(i + n, len(layers)) if method == "uniform" else i + 1
                with activation_region(i), host_offload(host):
                    x = recompute(partial(_run_chunk, layers[i:end]), self.rng, x, distribute=distribute)
                i = end
            else:
                with activation_region(i), host_offload(host and not full):
                    x = layers[i](x)
                i += 1
        return x

    def activation_setting(self, micro_batch_size: int, seq_length: int, dtype: torch.dtype,
                           device: torch.device) -> ActivationSetting:
        """What `mpzero.activations.formula` needs for this model's activation bytes on this rank."""
        return self.config.activation_setting(self.tp.size, micro_batch_size, seq_length, dtype, device,
                                              tp_rank=self.tp.rank,
                                              rng_streams=len(self.rng.states) if self.rng is not None else 1)

    def _mask_vocab_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """Padding ids get -inf logits, so the padded vocabulary never changes the loss."""
        local_vocab = logits.size(-1)
        first_padding = self.config.vocab_size - self.tp.rank * local_vocab
        if first_padding >= local_vocab:
            return logits
        padding = torch.arange(local_vocab, device=logits.device) >= first_padding
        return logits.masked_fill(padding, float("-inf"))
