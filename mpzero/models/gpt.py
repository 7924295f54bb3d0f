"""GPT-2 built from the tensor-parallel layers.

Learned positions, pre-LayerNorm blocks, causal self-attention with heads split across the TP group,
GELU MLP of width 4h, final LayerNorm, output projection tied to the vocab-parallel input embedding.
Activations are [batch, seq, hidden]. The model knows TP (it takes `groups.tp`) but not ZeRO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from mpzero.comm import CommGroup
from mpzero.errors import ConfigError
from mpzero.fused import layer_norm, scaled_masked_softmax
from mpzero.tensor_parallel import (ColumnParallelLinear, RNGStatesTracker, RowParallelLinear,
                                    VocabParallelEmbedding, copy_to_tp, mark_tensor_parallel, recompute,
                                    vocab_parallel_cross_entropy)


@dataclass(frozen=True)
class GPTConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    max_position_embeddings: int
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    make_vocab_size_divisible_by: int = 128
    recompute_activations: bool = False
    layernorm_impl: str = "auto"  # mpzero.fused implementations; --no-layernorm-fusion gives "torch"
    softmax_impl: str = "auto"  # --no-masked-softmax-fusion gives "torch"
    use_flash_attn: bool = False  # --use-flash-attn: torch's scaled_dot_product_attention (flash on GPUs)
    seq_length: int | None = None  # the training sequence length (FLOPs count); None: max_position_embeddings

    def validate(self, tp_size: int) -> None:
        if self.hidden_size % self.num_attention_heads != 0:
            raise ConfigError(f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                              f"{self.num_attention_heads}: choose sizes whose ratio is the head size")
        if self.num_attention_heads % tp_size != 0:
            raise ConfigError(f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                              f"--tensor-model-parallel-size {tp_size}: each TP rank must own whole heads")
        for name in ("num_layers", "hidden_size", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")

    def architecture(self) -> dict:
        """The settings that give the weights their meaning, by flag name: a checkpoint saved with other values
        is refused even where the tensor shapes agree (4 heads saved, 8 loaded: same QKV shape, other rows)."""
        names = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings",
                 "layernorm_epsilon")
        return {name: getattr(self, name) for name in names}

    def flops_per_token(self) -> float:
        """Model FLOPs per trained token, forward and backward: Narayanan et al. (2021)'s
        72 B s l h^2 (1 + s/(6h) + V/(16 l h)) per batch of B sequences, 96 with full recomputation (one more
        forward). The figure Megatron divides by time for TFLOP/s."""
        passes = 96 if self.recompute_activations else 72
        l, h, s = self.num_layers, self.hidden_size, self.seq_length or self.max_position_embeddings
        return passes * l * h ** 2 * (1 + s / (6 * h) + self.vocab_size / (16 * l * h))

    def padded_vocab_size(self, tp_size: int) -> int:
        """Megatron's --make-vocab-size-divisible-by, times TP so every rank gets an equal shard."""
        multiple = self.make_vocab_size_divisible_by * tp_size
        return -(-self.vocab_size // multiple) * multiple


def _normal(std: float):
    return partial(nn.init.normal_, mean=0.0, std=std)


class LayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the hidden dimension (mpzero.fused.layer_norm);
    replicated across the TP group. Statistics, weight and bias are used in fp32 whatever the
    parameters' storage dtype (ZeRO stores them in bf16/fp16 under mixed precision)."""

    def __init__(self, config: GPTConfig, device=None):
        super().__init__()
        self.eps, self.impl = config.layernorm_epsilon, config.layernorm_impl
        self.weight = mark_tensor_parallel(nn.Parameter(torch.ones(config.hidden_size, device=device)), None)
        self.bias = mark_tensor_parallel(nn.Parameter(torch.zeros(config.hidden_size, device=device)), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight.float(), self.bias.float(), self.eps, impl=self.impl)


class SelfAttention(nn.Module):
    """Causal multi-head attention; this TP rank computes heads [r*n/tp, (r+1)*n/tp).
    The fused QKV weight is laid out head by head ([heads, (q,k,v), head_dim] rows), so a contiguous
    column-parallel split hands each rank whole heads with their q, k and v."""

    def __init__(self, config: GPTConfig, tp: CommGroup, rng: RNGStatesTracker, device=None):
        super().__init__()
        h, std = config.hidden_size, config.init_method_std
        self.head_dim = h // config.num_attention_heads
        self.local_heads = config.num_attention_heads // tp.size
        self.rng, self.dropout, self.softmax_impl = rng, config.attention_dropout, config.softmax_impl
        self.use_flash_attn = config.use_flash_attn
        self.qkv = ColumnParallelLinear(h, 3 * h, tp, _normal(std), device=device)
        self.dense = RowParallelLinear(h, h, tp, _normal(std / math.sqrt(2 * config.num_layers)), device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, self.local_heads, 3, self.head_dim)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each [b, local_heads, s, head_dim]
        dropout = self.dropout if self.training else 0.0
        with self.rng.fork():  # heads differ across TP ranks, so must their dropout masks
            context = self._flash(q, k, v, dropout) if self.use_flash_attn else self._core(q, k, v, dropout)
        return self.dense(context.transpose(1, 2).reshape(b, s, -1))  # [b, s, h/tp] in, [b, s, h] out

    def _core(self, q, k, v, dropout: float) -> torch.Tensor:
        """Megatron's core attention: explicit scores, fused scale + causal mask + softmax, dropout."""
        scores = torch.matmul(q, k.transpose(-1, -2))  # [b, local_heads, s, s]
        probs = scaled_masked_softmax(scores, 1.0 / math.sqrt(self.head_dim), causal=True, impl=self.softmax_impl)
        return torch.matmul(F.dropout(probs, dropout) if dropout > 0 else probs, v)  # [b, local_heads, s, hd]

    def _flash(self, q, k, v, dropout: float) -> torch.Tensor:
        """The same maths in one kernel that never materializes [s, s] (FlashAttention on GPUs)."""
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)


class MLP(nn.Module):
    """h -> 4h (column-parallel, GELU on this rank's shard) -> h (row-parallel, all-reduced)."""

    def __init__(self, config: GPTConfig, tp: CommGroup, device=None):
        super().__init__()
        h, std = config.hidden_size, config.init_method_std
        self.fc1 = ColumnParallelLinear(h, 4 * h, tp, _normal(std), device=device)
        self.fc2 = RowParallelLinear(4 * h, h, tp, _normal(std / math.sqrt(2 * config.num_layers)), device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerLayer(nn.Module):
    """x + drop(attn(ln1(x))), then + drop(mlp(ln2(.))); hidden dropout is replicated across TP."""

    def __init__(self, config: GPTConfig, tp: CommGroup, rng: RNGStatesTracker, device=None):
        super().__init__()
        self.input_layernorm = LayerNorm(config, device)
        self.attention = SelfAttention(config, tp, rng, device)
        self.post_attention_layernorm = LayerNorm(config, device)
        self.mlp = MLP(config, tp, device)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.input_layernorm(x)))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


class GPTEmbedding(nn.Module):
    """Vocab-parallel token embedding plus replicated learned positions. Padding rows of the table
    start (and, receiving no gradient, stay) at zero."""

    def __init__(self, config: GPTConfig, tp: CommGroup, device=None):
        super().__init__()
        std, vocab = config.init_method_std, config.vocab_size

        def init_word(full: torch.Tensor) -> None:
            nn.init.normal_(full[:vocab], std=std)  # only real rows: the draw is the same at every TP size
            full[vocab:].zero_()

        self.word_embeddings = VocabParallelEmbedding(config.padded_vocab_size(tp.size), config.hidden_size,
                                                      tp, init_word, device)
        mark_tensor_parallel(self.word_embeddings.weight, 0, unpadded_size=vocab)
        # drawn from the CPU generator like every other weight, so a GPU run starts where a CPU run does
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        nn.init.normal_(self.position_embeddings.weight, std=std)
        self.position_embeddings.to(device)
        mark_tensor_parallel(self.position_embeddings.weight, None)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        return self.dropout(self.word_embeddings(tokens) + self.position_embeddings(positions))


class GPTModel(nn.Module):
    def __init__(self, config: GPTConfig, tp: CommGroup, rng: RNGStatesTracker, device=None):
        super().__init__()
        config.validate(tp.size)
        self.config, self.tp, self.rng = config, tp, rng
        self.embedding = GPTEmbedding(config, tp, device)
        self.layers = nn.ModuleList(TransformerLayer(config, tp, rng, device) for _ in range(config.num_layers))
        self.final_layernorm = LayerNorm(config, device)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [b, s] -> per-token losses [b, s] if labels are given, else this rank's logits [b, s, V/tp]."""
        if tokens.size(1) > self.config.max_position_embeddings:
            raise ConfigError(f"sequence length {tokens.size(1)} exceeds --max-position-embeddings "
                              f"{self.config.max_position_embeddings}")
        x = self.embedding(tokens)
        for layer in self.layers:
            x = recompute(layer, self.rng, x) if self.config.recompute_activations and self.training else layer(x)
        x = copy_to_tp(self.final_layernorm(x), self.tp)
        logits = F.linear(x, self.embedding.word_embeddings.weight)  # tied output projection, [b, s, V/tp]
        logits = self._mask_vocab_padding(logits)
        return logits if labels is None else vocab_parallel_cross_entropy(logits, labels, self.tp)

    def _mask_vocab_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """Padding ids get -inf logits, so the padded vocabulary never changes the loss."""
        local_vocab = logits.size(-1)
        first_padding = self.config.vocab_size - self.tp.rank * local_vocab
        if first_padding >= local_vocab:
            return logits
        padding = torch.arange(local_vocab, device=logits.device) >= first_padding
        return logits.masked_fill(padding, float("-inf"))
