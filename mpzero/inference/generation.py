"""Text generation from a GPTModel at any TP size: sampling and the batch loop over the model's own forward.

The KV cache goes through the model's forward (`model(tokens, cache=cache)`, `mpzero.models.KVCache`; grouped-query
attention caches only the key/value heads); `generate(..., use_cache=False)` runs the forward over the whole prefix
at every step instead, the reference the cache is tested and benchmarked against.

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
from torch import nn

from mpzero.errors import ConfigError
from mpzero.models import KVCache
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


def _full_logits(model: nn.Module, local_logits: torch.Tensor) -> torch.Tensor:
    """[b, V/tp] of this rank (padding masked) -> [b, V] fp32 on every rank, the padding cropped."""
    return gather_from_tp(local_logits, model.tp)[:, :model.config.vocab_size].float()


def forward_cached(model: nn.Module, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """tokens [b, s] at positions [cache.length, cache.length + s) -> the full logits of the last one [b, V]
    (the model's own forward, given the cache)."""
    return _full_logits(model, model(tokens, cache=cache)[:, -1])


def forward_full(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
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
def generate(model: nn.Module, prompts: list[list[int]], sampling: SamplingConfig, eod: int,
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
