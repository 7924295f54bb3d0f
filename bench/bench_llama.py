"""Seconds per training step (forward, backward, AdamW) of mpzero's LLaMA at TP=1 against a plain eager PyTorch
Llama of the same shape written here (nanoGPT style: RMSNorm, SwiGLU, rotate-half RoPE, grouped-query attention
through `F.scaled_dot_product_attention(enable_gqa=True)`, no biases, untied output, torch.optim.AdamW fused) and
against Megatron-Core's `GPTModel` with the same spec (when `megatron-core` is installed), measured in the same run.
mpzero runs as a world of one through its ZeRO-1 optimizer (the step a training run takes) with its default settings
(`mpzero`: attention backend auto, flash on a CPU without attention dropout) and with the local attention backend.
Every variant clips the global gradient norm at 1.0 before AdamW (mpzero's and Megatron's --clip-grad default,
nanoGPT's grad_clip; the baselines through torch.nn.utils.clip_grad_norm_), so each step is the same algorithm.
The variants take turns step by step (median of --steps after 2 warm-up rounds), so a shared machine's load falls
on all of them; each ratio is the median over rounds of the ratio within a round.

    pip install megatron-core     # optional: adds the megatron-core row (0.16.1 measured; no apex, no TE)
    python bench/bench_llama.py [--hidden-size 256 --num-layers 4 --seq-length 256 --micro-batch-size 8]

Megatron-Core on a CPU: its local layer spec (`get_gpt_layer_local_spec(normalization="RMSNorm")`: torch's RMSNorm,
Megatron's core attention with explicit scores and the unfused softmax, GQA by repeating K/V, the gated SwiGLU
linear_fc1) with every CUDA fusion off, `use_cpu_initialization`, and torch.optim.AdamW fused as its optimizer (its
own distributed optimizer needs CUDA). Three CUDA-only spots are stepped around, none inside the timed maths:
its RNG tracker (CUDA generator states; nothing is drawn with dropout 0, so a tracker whose fork does nothing),
RoPE's one-time move of its frequencies to `torch.cuda.current_device()` (patched to the CPU for the forward), and
the default causal mask made on CUDA (the bool [1, 1, s, s] mask is passed, as Megatron's training loop does).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch
import torch.nn.functional as F
from torch import nn

from bench_step import timed  # bench/bench_step.py, beside this script
from mpzero.models import GPTConfig, family_of
from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import seed_everything
from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer

CLIP_GRAD = AdamConfig().clip_grad  # mpzero's default, 1.0 (Megatron's): every variant clips by it


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
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD)
        opt.step()
        opt.zero_grad(set_to_none=True)
    step.numel = sum(p.numel() for p in model.parameters())
    return step


def mpzero_step(a, groups, backend):
    config = GPTConfig(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
                       vocab_size=a.vocab_size, max_position_embeddings=a.seq_length, hidden_dropout=0.0,
                       attention_dropout=0.0, attention_backend=backend, normalization="RMSNorm", swiglu=True,
                       ffn_hidden_size=a.ffn_hidden_size, position_embedding_type="rope",
                       group_query_attention=True, num_query_groups=a.num_query_groups, add_bias_linear=False,
                       untie_embeddings_and_output_weights=True, make_vocab_size_divisible_by=1)
    model = family_of(config).build(config, groups.tp, seed_everything(1, 0, groups.device), device=groups.device)
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=1), AdamConfig(lr=1e-4), PrecisionConfig("fp32"))

    def step(inputs, labels):
        opt.backward(model(inputs, labels).mean(), last_micro_batch=True)
        opt.step()
    step.numel = sum(p.numel() for p in model.parameters())
    step.attention = config.attention(groups.device)  # what `auto` resolved to
    return step


def megatron_core_step(a):
    """Megatron-Core's GPTModel with the spec above, or None when megatron-core is not installed."""
    try:
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel as MegatronGPT
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel import random as megatron_random
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError:
        return None
    from unittest import mock

    class _NoDrawTracker:  # dropout 0: the attention's fork draws nothing
        def fork(self, name=None):
            return contextlib.nullcontext()
    megatron_random._CUDA_RNG_STATE_TRACKER = _NoDrawTracker()
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    parallel_state.initialize_model_parallel(1, 1)  # over the gloo world of one that init_parallel made
    config = TransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
        num_query_groups=a.num_query_groups, ffn_hidden_size=a.ffn_hidden_size, normalization="RMSNorm",
        layernorm_epsilon=1e-5, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False)
    model = MegatronGPT(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=a.vocab_size,
                        max_sequence_length=a.seq_length, position_embedding_type="rope", rotary_base=10000,
                        share_embeddings_and_output_weights=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    positions = torch.arange(a.seq_length)[None].expand(a.micro_batch_size, -1)
    mask = torch.triu(torch.ones(1, 1, a.seq_length, a.seq_length, dtype=torch.bool), diagonal=1)  # True: masked

    def step(inputs, labels):
        with mock.patch("torch.cuda.current_device", lambda: "cpu"):  # RoPE's frequencies stay on the CPU
            loss = model(inputs, positions, mask, labels=labels)  # per-token losses [b, s]
        loss.mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD)
        opt.step()
        opt.zero_grad(set_to_none=True)
    step.numel = sum(p.numel() for p in model.parameters())
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
    steps = {"eager": eager_step(a), "mpzero": mpzero_step(a, groups, GPTConfig.attention_backend),
             "mpzero-local": mpzero_step(a, groups, "local")}
    megatron = megatron_core_step(a)
    if megatron is None:
        print("megatron-core is not installed: no megatron-core row (pip install megatron-core)")
    else:
        steps["megatron-core"] = megatron
    print("parameters: " + ", ".join(f"{name} {step.numel:,}" for name, step in steps.items()))  # the same spec
    print(f"mpzero's default attention backend (auto) on this device: {steps['mpzero'].attention}")
    # interleaved, one step of each variant per round: load from other processes hits every variant alike
    times = {name: [] for name in steps}
    for i in range(2 + a.steps):
        for name, step in steps.items():
            seconds = timed(step, inputs, labels, 1, warmup=0)
            if i >= 2:
                times[name].append(seconds)
    # time ratios, the goal's terms (at or below 1.0x eager and Megatron-Core), each the median over rounds of the
    # ratio within a round: the variants of one round ran back to back, so a load that drifts over the run cancels
    for name, samples in times.items():
        versus = "".join(f"  {statistics.median(t / r for t, r in zip(samples, times[other])):.3f}x {other}"
                         for other in ("eager", "megatron-core") if other in times)
        print(f"{name:14s} {statistics.median(samples) * 1000:8.1f} ms/step  time:{versus}", flush=True)

if __name__ == "__main__":
    main()
