"""Text generation from a GPTModel at any TP size: a KV cache over the model's own layers, and sampling.

The cached forward reuses the model's modules (embeddings, LayerNorms, the QKV and output projections, the MLP,
the output layer and the core attention maths for the prompt) and re-expresses only how attention reads keys and
values from the cache. The model's forward, which training runs, is untouched; `generate(..., use_cache=False)`
runs exactly it over the whole prefix at every step, the reference the cache is tested and benchmarked against.

Prompts of different lengths share a batch as in Megatron's generation: every row starts at the shortest prompt's
length, and a row whose prompt is longer keeps its own prompt tokens until it has passed them. Positions stay
aligned, so attention stays causal with no padding mask, and each row's tokens are the ones it gets alone.

Under TP each rank computes its heads and its vocabulary shard; the full logits are gathered on every rank, so
every rank draws the same token from the same CPU generator (seeded alike): the TP ranks agree without a
broadcast, and a seeded run draws the same tokens at every TP size and on CPU or GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mpzero.errors import ConfigError
from mpzero.fused import scaled_masked_softmax
from mpzero.models import GPTModel
from mpzero.tensor_parallel import gather_from_tp


@dataclass(frozen=True)
class SamplingConfig:
    """`greedy`: the most likely token (ties: the lowest id), as `transformers`' generate(do_sample=False).
    Otherwise logits / temperature, then top-k, then top-p (nucleus), then a draw: HF's order and semantics."""
    max_new_tokens: int = 64
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: every token
    top_p: float = 1.0  # 1: every token
    seed: int = 1234
    stop_at_eod: bool = True

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ConfigError(f"--temperature must be a positive number, got {self.temperature} (--greedy for argmax)")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be 0 (off) or positive, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"--top-p must lie in (0, 1], got {self.top_p}")


class KVCache:
    """Every layer's keys and values for positions [0, length), this rank's key/value heads (its query groups
    under GQA: the cache is heads/groups times smaller): [batch, local_groups, max_length, head_dim] each,
    RoPE already applied to the keys, filled as positions are computed."""

    def __init__(self, model: GPTModel, batch: int, max_length: int):
        attention = model.layers[0].attention
        weight = attention.qkv.weight
        shape = (batch, attention.local_groups, max_length, attention.head_dim)
        self.keys = [torch.zeros(shape, dtype=weight.dtype, device=weight.device) for _ in model.layers]
        self.values = [torch.zeros(shape, dtype=weight.dtype, device=weight.device) for _ in model.layers]
        self.length = 0


def _cached_attention(attention, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int):
    """SelfAttention.forward for positions [start, start + s) given the cached keys and values before them."""
    b, s, _ = x.shape
    q, k, v = attention.split_heads(attention.qkv(x), start)  # q [b, heads, s, d]; k, v [b, groups, s, d]
    keys[:, :, start:start + s], values[:, :, start:start + s] = k, v
    backend = attention.backend(x.device)
    if start == 0:  # the prompt: the model's own causal attention
        context = attention.attend(q, k, v, 0.0, backend)
    else:  # query i (position start + i) sees keys [0, start + i]
        k, v = keys[:, :, :start + s], values[:, :, :start + s]
        future = None  # one new position sees every key
        if s > 1:
            future = torch.arange(start + s, device=x.device) > torch.arange(start, start + s, device=x.device)[:, None]
        grouped = k.size(1) != q.size(1)
        if backend in ("flash", "fused"):  # any SDPA kernel: cuDNN's needs no mask of its own here
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=None if future is None else ~future,
                                                     enable_gqa=grouped)
        else:
            if grouped:  # each group's keys and values for each of its query heads
                k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
            scores = torch.matmul(q, k.transpose(-1, -2))  # [b, local_heads, s, start + s]
            probs = scaled_masked_softmax(scores, 1.0 / math.sqrt(attention.head_dim), causal=False, mask=future,
                                          impl="torch" if backend == "unfused" else attention.softmax_impl)
            context = torch.matmul(probs, v)
    return attention.dense(context.transpose(1, 2).reshape(b, s, -1))


def _full_logits(model: GPTModel, local_logits: torch.Tensor) -> torch.Tensor:
    """[b, V/tp] of this rank (padding masked) -> [b, V] fp32 on every rank, the padding cropped."""
    return gather_from_tp(local_logits, model.tp)[:, :model.config.vocab_size].float()


def forward_cached(model: GPTModel, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """tokens [b, s] at positions [cache.length, cache.length + s) -> the full logits of the last one [b, V]."""
    start, s = cache.length, tokens.size(1)
    if start + s > model.config.max_position_embeddings:
        raise ConfigError(f"position {start + s} exceeds --max-position-embeddings "
                          f"{model.config.max_position_embeddings}")
    x = model.embedding(tokens, start)  # learned positions from `start` (RoPE: in the attention); eval: no dropout
    for layer, keys, values in zip(model.layers, cache.keys, cache.values):
        x = x + _cached_attention(layer.attention, layer.input_layernorm(x), keys, values, start)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    cache.length += s
    x = model.final_layernorm(x[:, -1:])  # only the last position's logits are needed
    if model.output_layer is None:
        logits = F.linear(x, model.embedding.word_embeddings.weight)
    else:
        logits = model.output_layer(x)
    return _full_logits(model, model._mask_vocab_padding(logits)[:, -1])


def forward_full(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor:
    """The model's own forward over the whole prefix [b, s] -> the full logits of the last position [b, V]."""
    return _full_logits(model, model(tokens)[:, -1])


def next_tokens(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> torch.Tensor:
    """[b, V] fp32 logits (on the CPU to sample: `generator` is a CPU generator) -> [b] token ids."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    return torch.multinomial(filter_logits(logits, sampling).softmax(dim=-1), 1, generator=generator).squeeze(1)


def filter_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The logits a token is drawn from: / temperature, then -inf outside the top k and outside the top p."""
    logits = logits / sampling.temperature
    if sampling.top_k > 0:
        kth = torch.topk(logits, min(sampling.top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:  # drop the least likely tokens whose total probability is <= 1 - top_p
        ascending, order = torch.sort(logits, dim=-1, stable=True)
        drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1.0 - sampling.top_p
        drop[:, -1] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


@torch.no_grad()
def generate(model: GPTModel, prompts: list[list[int]], sampling: SamplingConfig, eod: int,
             use_cache: bool = True) -> list[list[int]]:
    """The new tokens of every prompt (each 1 <= length < max positions), an end-of-document token included
    when it stopped there. A row stops at `max_new_tokens`, at end-of-document (`stop_at_eod`) or at the
    model's last position. Every TP rank calls it with the same arguments and gets the same tokens."""
    limit = model.config.max_position_embeddings
    lengths = torch.tensor([len(p) for p in prompts])
    if len(prompts) == 0 or int(lengths.min()) < 1 or int(lengths.max()) >= limit:
        raise ConfigError(f"every prompt needs 1 to {limit - 1} tokens (--max-position-embeddings {limit}), "
                          f"got lengths {lengths.tolist()}")
    device = model.embedding.word_embeddings.weight.device
    total = min(int(lengths.max()) + sampling.max_new_tokens, limit)
    tokens = torch.full((len(prompts), total), eod, dtype=torch.long)  # [b, total] on the CPU
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    generator = torch.Generator().manual_seed(sampling.seed)
    cache = KVCache(model, len(prompts), total) if use_cache else None
    produced = torch.zeros(len(prompts), dtype=torch.long)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    computed, position = 0, int(lengths.min())  # tokens [0, computed) are in the cache; `position` is next
    while position < total and not bool(done.all()):
        if cache is not None:
            logits = forward_cached(model, tokens[:, computed:position].to(device), cache)
        else:
            logits = forward_full(model, tokens[:, :position].to(device))
        computed = position
        # greedy: the argmax where the logits are (one id per row to the host); sampling: the CPU generator's draw
        choice = next_tokens(logits if sampling.greedy else logits.cpu(), sampling, generator).cpu()
        generating = (lengths <= position) & ~done  # rows past their prompt and not finished
        tokens[:, position] = torch.where(generating, choice, tokens[:, position])
        produced += generating.long()
        stop = produced >= sampling.max_new_tokens
        if sampling.stop_at_eod:
            stop |= choice == eod
        done |= generating & stop
        position += 1
    return [tokens[row, n:n + int(produced[row])].tolist() for row, n in enumerate(lengths.tolist())]
