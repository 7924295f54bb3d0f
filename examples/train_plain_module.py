"""Train a plain torch.nn model (not mpzero's GPT) with mpzero's ZeRO optimizer, as a library.

    torchrun --nproc_per_node 2 examples/train_plain_module.py --zero-stage 3 --steps 20
    python examples/train_plain_module.py --reference           # the same model, torch.optim.AdamW, one process

A residual MLP classifier on synthetic data. What it shows of the API:
- `init_parallel(backend="gloo")`: the TP x DP grid (here TP 1, DP = the world), gloo on the CPU;
- `mark_replicated(model)`: a plain model's parameters say they are not split across tensor-parallel ranks;
- `ZeroOptimizer(..., decay=rule)`: which parameters AdamW decays is a parameter (here: matrices, but not the
  output head); at stage 3 the blocks of the `nn.ModuleList` are the units gathered one at a time;
- `opt.backward(loss, last_micro_batch=True)` then `opt.step(lr)`: DP-averaged gradients, the global norm,
  clipping and AdamW over each rank's 1/N partition.
Each step's loss is the mean over the global batch (every rank prints the same line; rank 0 prints). With the
same seed, ZeRO at any stage and DP size gives torch.optim.AdamW's single-process losses within 1e-5
(tests/test_library_api.py runs both).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import mark_replicated
from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer

FEATURES, WIDTH, CLASSES, DEPTH = 16, 64, 10, 3
LR, WEIGHT_DECAY, CLIP_GRAD = 3e-3, 0.1, 1.0


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def decays(name: str, param: nn.Parameter) -> bool:
    """AdamW's decoupled weight decay on the matrices, except the output head's (biases, LayerNorm: none)."""
    return param.ndim >= 2 and not name.startswith("head.")


def build_model(seed: int) -> Classifier:
    """The same initial weights for every caller: drawn under `seed`, the caller's global RNG left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Classifier()


def global_batch(step: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s samples: inputs and the labels a fixed random teacher gives them."""
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(seed))
    x = torch.randn(size, FEATURES, generator=torch.Generator().manual_seed(seed * 100_003 + step))
    return x, (x @ teacher).argmax(dim=-1)


def train_zero(steps: int, batch: int, stage: int, seed: int) -> list[float]:
    """Train under ZeRO over the whole world (an existing process group, or torchrun's, or a world of one)."""
    groups = init_parallel(tp_size=1, backend="gloo")
    dp, rank = groups.dp_size, groups.dp_rank
    if batch % dp:
        raise SystemExit(f"error: --batch {batch} is not divisible by the {dp} data-parallel ranks")
    model = mark_replicated(build_model(seed))
    optimizer = ZeroOptimizer(model, groups, ZeroConfig(stage=stage),
                              AdamConfig(lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=CLIP_GRAD),
                              PrecisionConfig("fp32"), decay=decays)
    losses = []
    for step in range(steps):
        x, y = global_batch(step, batch, seed)
        mine = slice(rank * batch // dp, (rank + 1) * batch // dp)  # this rank's share of the global batch
        loss = F.cross_entropy(model(x[mine]), y[mine])
        optimizer.backward(loss, last_micro_batch=True)  # gradients averaged over DP: the global batch's
        stats = optimizer.step()
        total = loss.detach().clone()
        groups.dp.all_reduce(total)
        losses.append(total.item() / dp)
        if groups.is_logging_rank:
            print(f"step {step + 1:4d} | loss {losses[-1]:.8e} | grad norm {stats.grad_norm:.6e}", flush=True)
    if groups.is_logging_rank:  # model-state bytes against the ZeRO formula; at stage 3 also the in-step peak
        print(optimizer.memory_report().line(), flush=True)
    return losses


def train_reference(steps: int, batch: int, seed: int) -> list[float]:
    """The same model, data and rule with torch.optim.AdamW in one process."""
    model = build_model(seed)
    named = list(model.named_parameters())
    optimizer = torch.optim.AdamW([{"params": [p for n, p in named if decays(n, p)], "weight_decay": WEIGHT_DECAY},
                                   {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}],
                                  lr=LR, foreach=False)
    losses = []
    for step in range(steps):
        x, y = global_batch(step, batch, seed)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD, foreach=False)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        print(f"step {step + 1:4d} | loss {losses[-1]:.8e}", flush=True)
    return losses


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32, help="global batch size (divisible by the world size)")
    parser.add_argument("--zero-stage", type=int, default=3, choices=(0, 1, 2, 3))
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--reference", action="store_true", help="torch.optim.AdamW in one process instead")
    args = parser.parse_args(argv)
    if args.reference:
        return train_reference(args.steps, args.batch, args.seed)
    owns_world = not dist.is_initialized()
    try:
        return train_zero(args.steps, args.batch, args.zero_stage, args.seed)
    finally:
        if owns_world and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
