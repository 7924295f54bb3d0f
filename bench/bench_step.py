"""Tokens/s of one training step (forward, backward, AdamW) of mpzero's GPT at TP=1 against a plain eager
PyTorch GPT-2 of the same size (nanoGPT style, `F.scaled_dot_product_attention`), measured in the same run.
mpzero runs twice: with Megatron's core attention (the default) and with `--use-flash-attn`.

    python bench/bench_step.py [--hidden-size 256 --num-layers 4 --seq-length 256 --micro-batch-size 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mpzero.models import GPTConfig, GPTModel  # noqa: E402
from mpzero.parallel import init_parallel  # noqa: E402
from mpzero.tensor_parallel import seed_everything  # noqa: E402


class EagerBlock(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class EagerGPT(nn.Module):
    def __init__(self, vocab, h, layers, heads, seq):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(EagerBlock(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)

    def forward(self, tokens, labels):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.size(1), device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.reshape(-1))


def time_steps(model, loss_fn, tokens, steps, warmup=2):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        loss_fn(model, tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args()
    groups = init_parallel(1)
    config = GPTConfig(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
                       vocab_size=a.vocab_size, max_position_embeddings=a.seq_length, hidden_dropout=0.0,
                       attention_dropout=0.0)
    tokens = torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_length + 1))
    n_tokens = a.micro_batch_size * a.seq_length
    eager = EagerGPT(a.vocab_size, a.hidden_size, a.num_layers, a.num_attention_heads, a.seq_length)
    t_eager = time_steps(eager, lambda m, t: m(t[:, :-1], t[:, 1:]), tokens, a.steps)
    print(f"threads {torch.get_num_threads()} | h {a.hidden_size} layers {a.num_layers} seq {a.seq_length} "
          f"batch {a.micro_batch_size} vocab {a.vocab_size}")
    print(f"eager PyTorch GPT            {n_tokens / t_eager:10.0f} tokens/s  ({t_eager * 1000:.1f} ms/step)")
    for flash in (False, True):
        ours = GPTModel(dataclasses.replace(config, use_flash_attn=flash), groups.tp,
                        seed_everything(1, 0, groups.device))
        t_ours = time_steps(ours, lambda m, t: m(t[:, :-1], t[:, 1:]).mean(), tokens, a.steps)
        name = "mpzero GPT, flash attn" if flash else "mpzero GPT, core attn "
        print(f"{name}       {n_tokens / t_ours:10.0f} tokens/s  ({t_ours * 1000:.1f} ms/step)  "
              f"ratio to eager {t_eager / t_ours:.3f}")


if __name__ == "__main__":
    main()
