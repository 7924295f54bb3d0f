"""A tiny GPT-shaped model for the ZeRO tests, and the single-process references they compare with.

Sizes are chosen so nothing divides evenly by 2 or 4 (vocab 37, hidden 10, MLP 23), the output
projection reuses the word embedding (weight tying, as GPTModel does), one parameter is frozen, and
`recompute=True` wraps each block in a reentrant checkpoint like Megatron's CheckpointFunction.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mpzero.tensor_parallel import mark_replicated

VOCAB, HIDDEN, FFN, SEQ = 37, 10, 23, 6


class _Checkpoint(torch.autograd.Function):
    """Megatron-style reentrant checkpoint: forward under no_grad, backward re-runs it under grad."""

    @staticmethod
    def forward(ctx, layer, x):
        ctx.layer = layer
        ctx.save_for_backward(x)
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = ctx.layer(x)
        torch.autograd.backward(out, grad)
        return None, x.grad


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.fc2 = nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ToyGPT(nn.Module):
    def __init__(self, num_layers: int = 2, recompute: bool = False):
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.position_embeddings = nn.Embedding(SEQ, HIDDEN)
        self.position_embeddings.weight.requires_grad_(False)  # the frozen parameter
        self.layers = nn.ModuleList(Block() for _ in range(num_layers))
        self.final_layernorm = nn.LayerNorm(HIDDEN)
        self.recompute = recompute

    def forward(self, tokens, labels):
        x = self.word_embeddings(tokens) + self.position_embeddings.weight[: tokens.shape[1]]
        for layer in self.layers:
            x = _Checkpoint.apply(layer, x) if self.recompute else layer(x)
        logits = self.final_layernorm(x) @ self.word_embeddings.weight.t()  # tied output projection
        return F.cross_entropy(logits.float().view(-1, VOCAB), labels.view(-1), reduction="none")


def make_model(seed: int = 0, **kwargs) -> ToyGPT:
    """A TP-1 model of plain torch.nn layers: every parameter marked replicated, as ZeroOptimizer requires."""
    torch.manual_seed(seed)
    return mark_replicated(ToyGPT(**kwargs))


def make_batches(steps: int, micro_batches: int, dp_size: int, batch: int = 2, seed: int = 1):
    """batches[step][micro_batch][dp_rank] = (tokens, labels): each DP rank gets its own slice."""
    gen = torch.Generator().manual_seed(seed)
    shape = (steps, micro_batches, dp_size, batch, SEQ)
    tokens, labels = torch.randint(0, VOCAB, shape, generator=gen), torch.randint(0, VOCAB, shape, generator=gen)
    return [[[(tokens[s, m, r], labels[s, m, r]) for r in range(dp_size)] for m in range(micro_batches)]
            for s in range(steps)]


def reference_adamw(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """torch's for-loop AdamW with Megatron's rule: no decay for parameters with ndim < 2."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
                              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                             lr=lr, foreach=False)


def reference_grads(model: nn.Module, step_batches, dp_size: int, per_micro_batch: bool) -> None:
    """p.grad = the DP-averaged gradient of one global batch, summed in ZeRO's order: stages 0-1
    accumulate micro-batches per rank, then add up rank / dp_size; stages 2-3 (`per_micro_batch`)
    add up rank / dp_size for each micro-batch, then accumulate the micro-batches."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    groups = [step_batches] if not per_micro_batch else [[micro] for micro in step_batches]
    for group in groups:
        reduced = [torch.zeros_like(p) for p in params]
        for rank in range(dp_size):
            for p in params:
                p.grad = None
            for micro in group:
                tokens, labels = micro[rank]
                (model(tokens, labels).mean() / len(step_batches)).backward()
            for r, p in zip(reduced, params):
                r.add_(p.grad / dp_size)
        for t, r in zip(total, reduced):
            t.add_(r)
    for t, p in zip(total, params):
        p.grad = t
