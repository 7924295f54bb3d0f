"""Pretrain a GPT with Megatron-style tensor parallelism and data parallelism.

    torchrun --nproc_per_node 4 pretrain_gpt.py --tensor-model-parallel-size 2 \
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \
        --micro-batch-size 2 --global-batch-size 8 --train-iters 10 --lr 1e-4 \
        --mock-data --vocab-size 1000 --log-interval 1

Plain `python pretrain_gpt.py ...` runs as a world of one. `main(argv)` is the whole run, callable from
tests; it returns the per-iteration losses and gradient norms.
"""

from __future__ import annotations

import math
import sys
import time

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from mpzero.arguments import gpt_config, parse_args
from mpzero.errors import ConfigError
from mpzero.models import GPTModel
from mpzero.parallel import ParallelGroups, init_parallel
from mpzero.tensor_parallel import seed_everything
from mpzero.training.batches import load_batch, micro_batch_indices, num_micro_batches
from mpzero.training.console import iteration_line
from mpzero.training.mock_data import MockGPTDataset


def main(argv: list[str] | None = None) -> dict:
    try:
        return _pretrain(parse_args(argv))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def _pretrain(args) -> dict:
    groups = init_parallel(args.tensor_model_parallel_size, args.distributed_timeout_minutes)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * groups.dp_size
    num_micro_batches(args.global_batch_size, args.micro_batch_size, groups.dp_size)  # validates
    config = gpt_config(args)
    rng = seed_everything(args.seed, groups.tp_rank, groups.device)
    model = GPTModel(config, groups.tp, rng, device=groups.device)
    optimizer = _adamw(model, args)
    dataset = MockGPTDataset(args.vocab_size, args.seq_length, args.seed,
                             num_samples=args.train_iters * args.global_batch_size)

    history = {"losses": [], "grad_norms": []}
    consumed, interval_losses, interval_start = 0, [], time.perf_counter()
    for iteration in range(1, args.train_iters + 1):
        loss, grad_norm = _train_step(model, optimizer, dataset, consumed, args, groups)
        consumed += args.global_batch_size
        history["losses"].append(loss)
        history["grad_norms"].append(grad_norm)
        interval_losses.append(loss)
        if iteration % args.log_interval == 0:
            elapsed_ms = (time.perf_counter() - interval_start) * 1000 / len(interval_losses)
            if groups.is_logging_rank:
                print(iteration_line(iteration, args.train_iters, consumed, elapsed_ms, args.lr,
                                     args.global_batch_size, sum(interval_losses) / len(interval_losses),
                                     grad_norm, skipped=0, nan=0), flush=True)
            interval_losses, interval_start = [], time.perf_counter()
    return history


def _train_step(model, optimizer, dataset, consumed, args, groups: ParallelGroups) -> tuple[float, float]:
    """One global batch: forward/backward every micro-batch, average gradients over DP, clip, step."""
    optimizer.zero_grad(set_to_none=False)
    micro_batches = micro_batch_indices(consumed, args.global_batch_size, args.micro_batch_size,
                                        groups.dp_rank, groups.dp_size)
    total = torch.zeros((), device=groups.device)
    for indices in micro_batches:
        tokens = load_batch(dataset, indices, groups.device)
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean() / len(micro_batches)
        loss.backward()
        total += loss.detach()
    params = [p for p in model.parameters() if p.requires_grad]
    _average_over_dp([p.grad for p in params], groups)
    grad_norm = _clip_grad_norm(params, args.clip_grad, groups)
    optimizer.step()
    groups.dp.all_reduce(total)
    return total.item() / groups.dp_size, grad_norm


def _average_over_dp(grads: list[torch.Tensor], groups: ParallelGroups) -> None:
    if groups.dp_size == 1:
        return
    flat = _flatten_dense_tensors(grads)
    groups.dp.all_reduce(flat)
    flat /= groups.dp_size
    for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(synced)


def _clip_grad_norm(params, max_norm: float, groups: ParallelGroups) -> float:
    """Global L2 norm where TP-sharded gradients are summed over TP and replicated ones count once."""
    zero = torch.zeros((), device=groups.device)
    sharded = sum((p.grad.float().pow(2).sum() for p in params if p.tensor_parallel), zero)
    replicated = sum((p.grad.float().pow(2).sum() for p in params if not p.tensor_parallel), zero)
    groups.tp.all_reduce(sharded)
    norm = math.sqrt((sharded + replicated).item())
    if max_norm > 0 and norm > max_norm:
        for p in params:
            p.grad.mul_(max_norm / (norm + 1e-6))
    return norm


def _adamw(model: torch.nn.Module, args) -> torch.optim.Optimizer:
    """AdamW without weight decay on biases and LayerNorm (parameters with fewer than 2 dimensions)."""
    params = [p for p in model.parameters() if p.requires_grad]
    param_groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay},
                    {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(param_groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_eps, foreach=False)


if __name__ == "__main__":
    main()
