"""TEMPORARY (replaced by ZeRO stage 0 from mpzero.zero, issue 3): replicated AdamW with the DP all-reduce."""

from __future__ import annotations

import math

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from mpzero.parallel import ParallelGroups


class PlainDataParallelAdamW:
    def __init__(self, model, groups: ParallelGroups, args):
        self.groups, self.clip_grad = groups, args.clip_grad
        self.params = [p for p in model.parameters() if p.requires_grad]
        param_groups = [{"params": [p for p in self.params if p.ndim >= 2], "weight_decay": args.weight_decay},
                        {"params": [p for p in self.params if p.ndim < 2], "weight_decay": 0.0}]
        self.adam = torch.optim.AdamW(param_groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                                      eps=args.adam_eps, foreach=False)

    def zero_grad(self):
        self.adam.zero_grad(set_to_none=False)

    def backward(self, loss, last_micro_batch: bool):
        loss.backward()

    def step(self, lr: float) -> tuple[float, bool]:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self.groups.dp_size > 1:
            flat = _flatten_dense_tensors(grads)
            self.groups.dp.all_reduce(flat)
            flat /= self.groups.dp_size
            for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(synced)
        for p, g in zip(self.params, grads):
            p.grad = g
        norm = self._clip()
        for group in self.adam.param_groups:
            group["lr"] = lr
        self.adam.step()
        return norm, False

    def _clip(self) -> float:
        zero = torch.zeros((), device=self.groups.device)
        sharded = sum((p.grad.float().pow(2).sum() for p in self.params if p.tensor_parallel), zero)
        replicated = sum((p.grad.float().pow(2).sum() for p in self.params if not p.tensor_parallel), zero)
        self.groups.tp.all_reduce(sharded)
        norm = math.sqrt((sharded + replicated).item())
        if self.clip_grad > 0 and norm > self.clip_grad:
            for p in self.params:
                p.grad.mul_(self.clip_grad / (norm + 1e-6))
        return norm
