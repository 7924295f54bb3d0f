"""Seconds per training step (forward, backward, AdamW) of mpzero's LLaMA at TP=1 against a plain eager PyTorch
Llama of the same shape written here (nanoGPT style: RMSNorm, SwiGLU, rotate-half RoPE, grouped-query attention
through `F.scaled_dot_product_attention(enable_gqa=True)`, no biases, untied output, torch.optim.AdamW fused), measured
in the same run. mpzero runs as a world of one through its ZeRO-1 optimizer (the step a training run takes), with
the local and the flash attention backends. The variants take turns step by step (median of --steps after 2
warm-up rounds), so a shared machine's load falls on all of them.

    python bench/bench_llama.py [--hidden-size 256 --num-layers 4 --seq-length 256 --micro-batch-size 8]

Megatron-Core's GPT with the same spec is not compared here (it needs Transformer Engine or apex for its fused
paths and CUDA for most of them); the eager model is the reference.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch import nn

from bench_step import timed  # bench/bench_step.py, beside this script
from mpzero.models import GPTConfig, GPTModel
from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import seed_everything
from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer


class EagerLlama(nn.Module):
    def __init__(self, vocab, h, layers, heads, groups, ffn, seq, theta=10000.0):
        super().__init__()
        self.heads, self.groups, self.d = heads, groups, h // heads
        self.embed = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "ln1": nn.RMSNorm(h, eps=1e-5), "qkv": nn.Linear(h, (heads + 2 * groups) * self.d, bias=False),
            "o": nn.Linear(h, h, bias=False), "ln2": nn.RMSNorm(h, eps=1e-5),
            "gate_up": nn.Linear(h, 2 * ffn, bias=False), "down": nn.Linear(ffn, h, bias=False)})
            for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(h, eps=1e-5), nn.Linear(h, vocab, bias=False)
        inv = 1.0 / theta ** (torch.arange(0, self.d, 2).float() / self.d)
        angles = torch.outer(torch.arange(seq).float(), inv)
        self.register_buffer("cos", torch.cat((angles, angles), -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat((angles, angles), -1).sin(), persistent=False)

    def _rope(self, x):
        half = x.size(-1) // 2
        return x * self.cos + torch.cat((-x[..., half:], x[..., :half]), -1) * self.sin

    def forward(self, tokens, labels):
        b, s = tokens.shape
        x = self.embed(tokens)
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).split([self.heads * self.d, self.groups * self.d,
                                                       self.groups * self.d], dim=-1)
            q = self._rope(q.view(b, s, self.heads, self.d).transpose(1, 2))
            k = self._rope(k.view(b, s, self.groups, self.d).transpose(1, 2))
            v = v.view(b, s, self.groups, self.d).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + blk["o"](y.transpose(1, 2).reshape(b, s, -1))
            gate, up = blk["gate_up"](blk["ln2"](x)).chunk(2, dim=-1)
            x = x + blk["down"](F.silu(gate) * up)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), labels.flatten())


def eager_step(a):
    model = EagerLlama(a.vocab_size, a.hidden_size, a.num_layers, a.num_attention_heads, a.num_query_groups,
                       a.ffn_hidden_size, a.seq_length)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # as mpzero's CPU choice (torch_fused)

    def step(inputs, labels):
        model(inputs, labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def mpzero_step(a, groups, backend):
    config = GPTConfig(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
                       vocab_size=a.vocab_size, max_position_embeddings=a.seq_length, hidden_dropout=0.0,
                       attention_dropout=0.0, attention_backend=backend, normalization="RMSNorm", swiglu=True,
                       ffn_hidden_size=a.ffn_hidden_size, position_embedding_type="rope",
                       group_query_attention=True, num_query_groups=a.num_query_groups, add_bias_linear=False,
                       untie_embeddings_and_output_weights=True, make_vocab_size_divisible_by=1)
    model = GPTModel(config, groups.tp, seed_everything(1, 0, groups.device), device=groups.device)
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=1), AdamConfig(lr=1e-4), PrecisionConfig("fp32"))

    def step(inputs, labels):
        opt.backward(model(inputs, labels).mean(), last_micro_batch=True)
        opt.step()
    return step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--num-query-groups", type=int, default=2)
    p.add_argument("--ffn-hidden-size", type=int, default=704)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args(argv)
    groups = init_parallel(1)
    tokens = torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_length + 1))
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    print(f"cpu, threads {torch.get_num_threads()}, fp32 | h {a.hidden_size} layers {a.num_layers} heads "
          f"{a.num_attention_heads} groups {a.num_query_groups} ffn {a.ffn_hidden_size} seq {a.seq_length} batch "
          f"{a.micro_batch_size} vocab {a.vocab_size} | median of {a.steps} steps")
    steps = {"eager": eager_step(a), "mpzero-local": mpzero_step(a, groups, "local"),
             "mpzero-flash": mpzero_step(a, groups, "flash")}
    # interleaved, one step of each variant per round: load from other processes hits every variant alike
    times = {name: [] for name in steps}
    for i in range(2 + a.steps):
        for name, step in steps.items():
            seconds = timed(step, inputs, labels, 1, warmup=0)
            if i >= 2:
                times[name].append(seconds)
    eager = statistics.median(times["eager"])
    for name, samples in times.items():
        seconds = statistics.median(samples)
        print(f"{name:14s} {seconds * 1000:8.1f} ms/step  ratio to eager {eager / seconds:.3f}", flush=True)

if __name__ == "__main__":
    main()
