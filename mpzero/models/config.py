"""The transformer's configuration in two layers: `TransformerArchitecture`, what the weights are (shapes, parts,
the settings that give them their meaning: what a checkpoint's architecture check, the HF adapters and the
parameter shapes read), and `GPTConfig`, that architecture plus how a run computes it (dropout, recomputation,
sequence parallelism, activation offload, fused-op and attention backends, compilation, the loss in chunks, the
initialization seed). One flat constructor, Megatron's flag names as field names:

    GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1000, max_position_embeddings=128)

GPT-2 is the default; the LLaMA family is the same transformer with other parts (RMSNorm, SwiGLU, RoPE,
grouped-query attention, no biases, untied output weights), chosen by the fields named after Megatron's flags.
Each check is one ConfigError line (Megatron's rules where it has them). FLOPs per token and the activation
setting are the run's (they depend on recomputation), so they live on `GPTConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpzero.activations import CPU_RNG_STATE_BYTES, CUDA_RNG_STATE_BYTES, ActivationSetting
from mpzero.context_parallel import check_context_parallel
from mpzero.errors import ConfigError
from mpzero.fused import (ATTENTION_BACKENDS, IMPLS, AttentionShape, planned_attention_backend, planned_impl,
                          resolve_attention_backend)
from mpzero.models.flops import flops_per_token
from mpzero.models.memory_flags import check_activation_memory
from mpzero.moe import check_moe
from mpzero.tensor_parallel import Fp8Recipe, check_fp8_flags


NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")
CUDA_GRAPH_IMPLS = ("none", "local")  # Megatron's --cuda-graph-impl choices that mpzero has


@dataclass(frozen=True)
class TransformerArchitecture:
    """What the weights are: their shapes and the choices that give them their meaning (Megatron's flags)."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    max_position_embeddings: int
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    make_vocab_size_divisible_by: int = 128
    untie_embeddings_and_output_weights: bool = False  # --untie-embeddings-and-output-weights: own output weight
    openai_gelu: bool = False  # --openai-gelu: GELU's tanh approximation (GPT-2's), instead of the exact erf form
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
    qk_layernorm: bool = False  # --qk-layernorm: --normalization over each head's q and k (Qwen3's q_norm, k_norm)
    kv_channels: int | None = None  # --kv-channels: projection size per attention head; None: hidden / heads
    # Mixture of experts (mpzero/moe), Megatron's flags with Megatron's meanings; None experts: a dense model
    num_experts: int | None = None  # --num-experts: routed experts of each MoE layer
    moe_ffn_hidden_size: int | None = None  # --moe-ffn-hidden-size: an expert's width; None: --ffn-hidden-size's
    moe_layer_freq: int | tuple[int, ...] = 1  # --moe-layer-freq: every N-th layer is MoE, or a 0/1 per layer
    moe_router_topk: int = 2  # --moe-router-topk: experts each token is routed to
    moe_router_score_function: str = "softmax"  # --moe-router-score-function: softmax or sigmoid
    moe_router_pre_softmax: bool = False  # --moe-router-pre-softmax: scores over all experts before the top-k
    moe_router_num_groups: int | None = None  # --moe-router-num-groups: expert groups for group-limited routing
    moe_router_group_topk: int | None = None  # --moe-router-group-topk: groups each token may use
    moe_router_enable_expert_bias: bool = False  # --moe-router-enable-expert-bias: aux-loss-free balancing bias
    moe_router_topk_scaling_factor: float | None = None  # --moe-router-topk-scaling-factor: gates x it; None: x 1
    moe_shared_expert_intermediate_size: int | None = None  # --moe-shared-expert-intermediate-size

    @property
    def expert_ffn_size(self) -> int:
        """An expert's MLP width: --moe-ffn-hidden-size, else the dense MLP's (Megatron's default)."""
        return self.moe_ffn_hidden_size or self.ffn_size

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) holds a mixture of experts (--moe-layer-freq: every N-th from the first,
        or the pattern's entry)."""
        if not self.num_experts:
            return False
        freq = self.moe_layer_freq
        return bool(freq[layer]) if isinstance(freq, tuple) else layer % freq == 0

    @property
    def head_dim(self) -> int:
        """Each attention head's size (Megatron's kv_channels): --kv-channels, else hidden / heads."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def attention_width(self) -> int:
        """The query heads' total size: the projection's input (heads x head size; h by default)."""
        return self.num_attention_heads * self.head_dim

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

    def _validate_shapes(self, tp_size: int) -> None:
        """Heads of whole size, whole heads per TP rank, positive sizes."""
        if self.kv_channels is not None and self.kv_channels < 1:
            raise ConfigError(f"--kv-channels {self.kv_channels} must be positive (each attention head's size)")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads != 0:
            raise ConfigError(f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                              f"{self.num_attention_heads}: choose sizes whose ratio is the head size, or give "
                              f"the head size as --kv-channels")
        if self.num_attention_heads % tp_size != 0:
            raise ConfigError(f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                              f"--tensor-model-parallel-size {tp_size}: each TP rank must own whole heads")
        for name in ("num_layers", "hidden_size", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")

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
                              f"{self.rotary_dim} features: RoPE needs an even number, at least 2 (the head size "
                              f"is --kv-channels, else --hidden-size / --num-attention-heads)")

    def architecture(self) -> dict:
        """The settings that give the weights their meaning, by flag name: a checkpoint saved with other values
        is refused even where the tensor shapes agree (4 heads saved, 8 loaded: same QKV shape, other rows)."""
        names = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings",
                 "layernorm_epsilon", "untie_embeddings_and_output_weights", "openai_gelu", "normalization",
                 "swiglu", "rotary_base", "rotary_percent", "add_bias_linear", "qk_layernorm", "num_experts",
                 "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax", "moe_router_num_groups",
                 "moe_router_group_topk", "moe_router_enable_expert_bias", "moe_shared_expert_intermediate_size",
                 "moe_router_topk_scaling_factor")
        position = ("learned_absolute" if self.learned_positions
                    else "rope" if self.position_embedding_type == "rope" else "none")
        arch = {**{name: getattr(self, name) for name in names}, "ffn_hidden_size": self.ffn_size,
                "num_query_groups": self.query_groups, "kv_channels": self.head_dim,
                "position_embedding_type": position}
        if position != "rope":  # unused without RoPE: not part of what the weights mean
            arch["rotary_base"] = arch["rotary_percent"] = None
        if self.num_experts:
            freq = self.moe_layer_freq
            arch.update(moe_ffn_hidden_size=self.expert_ffn_size,
                        moe_layer_freq=list(freq) if isinstance(freq, tuple) else freq)
        else:  # a dense model: the MoE settings mean nothing
            arch.update({name: None for name in names if name.startswith(("num_experts", "moe_"))})
        return arch

    def padded_vocab_size(self, tp_size: int) -> int:
        """Megatron's --make-vocab-size-divisible-by, times TP so every rank gets an equal shard."""
        multiple = self.make_vocab_size_divisible_by * tp_size
        return -(-self.vocab_size // multiple) * multiple


@dataclass(frozen=True)
class GPTConfig(TransformerArchitecture):
    """The architecture and how a run computes it: what `GPTModel` takes."""
    hidden_dropout: float = 0.1  # Megatron's defaults, as the flags' (--hidden-dropout, --attention-dropout)
    attention_dropout: float = 0.1
    recompute_activations: bool = False  # Megatron's flag: selective recomputation (recompute_granularity "selective")
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
    torch_compile: bool = False  # --torch-compile: each TransformerLayer's forward through torch.compile (gpt.py)
    cuda_graph_impl: str = "none"  # --cuda-graph-impl local: the compiled trunk's CUDA graphs replayed (gpt.py)
    seq_length: int | None = None  # the training sequence length (FLOPs count); None: max_position_embeddings
    init_seed: int = 1234  # seeds the model's own initialization generator (pretrain_gpt.py: --seed)
    cross_entropy_chunk_size: int = 2048  # --cross-entropy-chunk-size: projection + loss per N tokens; 0: logits
    cross_entropy_impl: str = "auto"  # a chunk's arithmetic (mpzero.fused): --cross-entropy-loss-fusion: "compile"
    context_parallel_size: int = 1  # --context-parallel-size: the sequence split over CP ranks (context_parallel)
    cp_comm_type: str = "p2p"  # --cp-comm-type: p2p (ring), all_gather, a2a (all-to-all over heads, Ulysses)
    # how a mixture of experts routes and computes (mpzero/moe), Megatron's flags and defaults
    moe_router_load_balancing_type: str = "aux_loss"  # --moe-router-load-balancing-type: aux_loss, seq_aux_loss, none
    moe_aux_loss_coeff: float = 0.0  # --moe-aux-loss-coeff: the Switch load-balancing loss's coefficient
    moe_z_loss_coeff: float | None = None  # --moe-z-loss-coeff: the router z-loss's coefficient (None: none)
    moe_router_bias_update_rate: float = 1e-3  # --moe-router-bias-update-rate: the expert bias's step
    moe_router_dtype: str | None = None  # --moe-router-dtype: fp32 or fp64 routing (None: fp32 logits here)
    moe_expert_capacity_factor: float | None = None  # --moe-expert-capacity-factor: None is dropless
    moe_token_drop_policy: str = "probs"  # --moe-token-drop-policy: probs or position
    moe_token_dispatcher_type: str = "allgather"  # --moe-token-dispatcher-type: allgather or alltoall
    moe_grouped_gemm: bool = False  # --moe-grouped-gemm: the local experts in one grouped GEMM

    @property
    def cp_blockwise(self) -> bool:
        """The attention runs mpzero's blockwise context-parallel core (p2p, all_gather: the local queries over
        the whole sequence's keys block by block, each block on the CPU's flash kernel or in explicit scores:
        `mpzero.context_parallel.block_kernel`); a2a runs the attention backend on 1/CP of the heads."""
        return self.context_parallel_size > 1 and self.cp_comm_type != "a2a"

    # FP8 matmuls in the transformer layers' linears (mpzero/tensor_parallel/fp8.py, through torchao); compute only:
    # the weights and checkpoints are the bf16 run's. Megatron's flags, and torchtitan's small-GEMM filter.
    fp8_format: str | None = None  # --fp8-format: e4m3 or hybrid; None: no FP8
    fp8_recipe: str = "tensorwise"  # --fp8-recipe: torchao's tensorwise, rowwise or rowwise_with_gw_hp
    fp8_auto_filter_small_kn: bool = False  # --fp8-auto-filter-small-kn: GEMMs torchao finds slower in FP8 stay bf16
    first_last_layers_bf16: bool = False  # --first-last-layers-bf16: the first and last layers' linears stay bf16
    num_layers_at_start_in_bf16: int = 1  # --num-layers-at-start-in-bf16 (with --first-last-layers-bf16)
    num_layers_at_end_in_bf16: int = 1  # --num-layers-at-end-in-bf16

    @property
    def fp8(self) -> Fp8Recipe | None:
        """The FP8 recipe of the layers' linears, or None without --fp8-format."""
        return None if self.fp8_format is None else Fp8Recipe(self.fp8_format, self.fp8_recipe,
                                                              self.fp8_auto_filter_small_kn)

    def bf16_layers(self) -> set[int]:
        """Layer indices whose linears stay in bf16 under FP8 (--first-last-layers-bf16, Megatron's)."""
        if not self.first_last_layers_bf16:
            return set()
        start, end = self.num_layers_at_start_in_bf16, self.num_layers_at_end_in_bf16
        return set(range(start)) | set(range(self.num_layers - end, self.num_layers))

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
        check_activation_memory(self, tp_size)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"--attention-backend {self.attention_backend} is not one of "
                              f"{', '.join(ATTENTION_BACKENDS)}")
        if self.use_flash_attn and self.attention_backend not in ("auto", "flash"):
            raise ConfigError(f"--use-flash-attn means --attention-backend flash, but --attention-backend "
                              f"{self.attention_backend} was given too: keep one of them")
        if self.cross_entropy_impl not in ("auto",) + IMPLS["cross_entropy"]:
            raise ConfigError(f"cross_entropy_impl {self.cross_entropy_impl!r} is not one of auto, "
                              f"{', '.join(IMPLS['cross_entropy'])}")
        self._validate_cuda_graphs(tp_size)
        if self.cross_entropy_impl == "compile" and not self.cross_entropy_chunk_size:
            raise ConfigError("--cross-entropy-loss-fusion fuses the chunked loss's arithmetic: it needs "
                              "--cross-entropy-chunk-size > 0 (0 is the logits path)")
        self._validate_shapes(tp_size)
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"--{name.replace('_', '-')} must lie in [0, 1), got {getattr(self, name)}")
        self._validate_family(tp_size)
        check_context_parallel(self, tp_size)
        check_fp8_flags(self)
        check_moe(self, tp_size)

    def trunk_eager_reason(self, tp_size: int) -> str | None:
        """Why the trunk (embedding, layers, final norm) cannot be one compiled region, or None where it can: what
        in it must run eagerly (`mpzero.models.gpt.trunk_compilable`)."""
        if tp_size > 1:
            return "at TP > 1 each layer's collectives run eagerly"
        if self.num_experts:
            return "mixture-of-experts layers dispatch their tokens eagerly"
        if self.granularity is not None:
            return f"{self.granularity} recomputation runs eagerly around or inside the layers"
        if self.offload_activations == "cpu":
            return "--offload-activations cpu moves the saved tensors to the host from eager hooks"
        return None

    def _validate_cuda_graphs(self, tp_size: int) -> None:
        if self.cuda_graph_impl not in CUDA_GRAPH_IMPLS:
            raise ConfigError(f"--cuda-graph-impl {self.cuda_graph_impl} is not one of {', '.join(CUDA_GRAPH_IMPLS)}")
        if self.cuda_graph_impl == "none":
            return
        if not self.torch_compile:
            raise ConfigError("--cuda-graph-impl local replays the CUDA graphs of the model's compiled trunk: add "
                              "--torch-compile")
        reason = self.trunk_eager_reason(tp_size)
        if reason:
            raise ConfigError(f"--cuda-graph-impl local captures the trunk compiled as one region, which it cannot be "
                              f"here ({reason}): drop --cuda-graph-impl local")

    def cuda_graphs(self, device: torch.device | str) -> str:
        """The CUDA graphs this config replays on a device of `device`'s type, as the `fused ops` line prints it."""
        if self.cuda_graph_impl == "none" or torch.device(device).type == "cuda":
            return self.cuda_graph_impl
        return f"none ({self.cuda_graph_impl} captures CUDA graphs; this device is {torch.device(device).type})"

    def attention(self, device: torch.device | str) -> str:
        """The attention backend this config runs on a device of `device`'s type: flash, fused, unfused or
        local (`mpzero.fused.impl.resolve_attention_backend`: auto depends on the device and the attention
        dropout; --use-flash-attn is flash)."""
        return resolve_attention_backend(self.attention_backend_name, device, dropout=self.attention_dropout)

    def planned_attention(self, device: torch.device | str) -> str:
        """`attention(device)` without its check that the backend can run there (a CPU machine plans a CUDA
        run)."""
        return planned_attention_backend(self.attention_backend_name, device, dropout=self.attention_dropout)

    def attention_shape(self, tp_size: int, seq_length: int, dtype: torch.dtype) -> AttentionShape:
        """One TP rank's attention at `seq_length` in `dtype`: what a run asks torch's fused attention kernels
        about at start (`mpzero.fused.fused_attention_refusal`); under --cp-comm-type a2a 1/CP of its heads."""
        split = tp_size * (self.context_parallel_size if self.cp_comm_type == "a2a" else 1)
        return AttentionShape(self.num_attention_heads // split, self.query_groups // split, self.head_dim,
                              seq_length, dtype, self.attention_dropout)

    @property
    def attention_backend_name(self) -> str:
        """--attention-backend as asked (--use-flash-attn is flash), before `auto` is resolved for a device."""
        return "flash" if self.use_flash_attn else self.attention_backend

    @property
    def needs_rng(self) -> bool:
        """Dropout or recomputation draw from (or replay) an RNG tracker; without them none is needed."""
        return self.hidden_dropout > 0 or self.attention_dropout > 0 or self.granularity is not None

    def flops_per_token(self, tp_size: int = 1, micro_batch_size: int = 1) -> float:
        """Matmul FLOPs per trained token, forward and backward, as Megatron counts them (`models/flops.py`)."""
        return flops_per_token(self, tp_size, micro_batch_size)

    def activation_setting(self, tp_size: int, micro_batch_size: int, seq_length: int, dtype: torch.dtype,
                           device: torch.device | str = "cpu", tp_rank: int = 0,
                           rng_streams: int = 1) -> ActivationSetting:
        """The shape and modes `mpzero.activations.formula` needs for the activation bytes of TP rank `tp_rank`
        (only the vocabulary padding mask depends on it), with activations and parameters in `dtype`, on a
        device of `device`'s type (CPU dropout masks in the input dtype, CUDA's bool; RNG state sizes). Under
        context parallelism a rank holds `seq_length` / CP tokens."""
        device = torch.device(device)
        attention = self.planned_attention(device)
        return ActivationSetting(
            seq_length=seq_length // self.context_parallel_size, micro_batch_size=micro_batch_size,
            hidden_size=self.hidden_size, kv_channels=self.head_dim,
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
            flash_attention=attention in ("flash", "fused") or self.cp_blockwise, compiled_layers=self.torch_compile,
            rng_state_bytes=CUDA_RNG_STATE_BYTES if device.type == "cuda" else CPU_RNG_STATE_BYTES,
            rng_streams=rng_streams, cross_entropy_chunk_size=self.cross_entropy_chunk_size,
            ffn_hidden_size=self.ffn_size, num_query_groups=self.query_groups,
            rms_norm=self.normalization == "RMSNorm", swiglu=self.swiglu,
            rotary=self.position_embedding_type == "rope", learned_positions=self.learned_positions,
            qk_layernorm=self.qk_layernorm,
            cp=self.context_parallel_size, cp_comm_type=self.cp_comm_type,
            moe_layers=sum(self.is_moe_layer(i) for i in range(self.num_layers)))

