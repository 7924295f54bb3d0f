"""Zero bubble's split backward (Qi et al., "Zero Bubble Pipeline Parallelism"): the backward of a micro-batch in
two passes, I (every gradient but the linear layers' weight gradients, so the input gradient can travel on at
once) and W (the weight gradients, computed later where a pipeline would idle).

While a `WeightGradStore` is `deferring`, a tensor-parallel linear's backward computes its input (and bias)
gradient and queues what its weight gradient needs (its input, the output gradient, the weight); `run(key)` then
computes them, in the order queued, and hands each to its weight through autograd (`weight.backward(grad)`), so
ZeRO's gradient hooks receive it as from any backward. The arithmetic is autograd's own for `F.linear`
(dW = dy^T x over the flattened tokens; sequence parallelism: dy^T gather(x)), so a schedule that splits the
backward trains the same numbers as one that does not.

The deferring linear runs outside torch.compile (its backward has a side effect a compiled graph cannot hold): with
`--torch-compile` each transformer layer compiles around its linears' matmuls.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any

import torch
import torch.nn.functional as F

from mpzero.comm import CommGroup, eager_under_compile
from mpzero.storages import storage_key


class WeightGradStore:
    """The queued weight gradients by key, and the bytes they hold: each `put` names the tensors its computation
    keeps alive (a linear's input and output gradient), and `held_bytes` is their distinct storages' bytes, the
    activation memory zero bubble adds between a micro-batch's I and its W (parameters are not named: they are
    no activation)."""

    def __init__(self):
        self.deferring: Any = None  # the key (e.g. (chunk, micro-batch)) weight gradients are queued under
        self._queued: dict[Any, list] = defaultdict(list)
        self._storages: dict = {}  # storage key -> [bytes, how many kept tensors use it]
        self.held_bytes = 0

    @contextlib.contextmanager
    def defer(self, key):
        """Queue the weight gradients of the backward run inside under `key`."""
        self.deferring = key
        try:
            yield
        finally:
            self.deferring = None

    def put(self, compute, weight: torch.Tensor, kept: tuple[torch.Tensor, ...] = ()) -> None:
        """Queue `compute` (-> the weight's gradient) under the key deferring now; `kept`: the tensors it holds."""
        self._queued[self.deferring].append((compute, weight, kept))
        for tensor in kept:
            self._count(tensor, 1)

    def run(self, key) -> None:
        """The W pass of `key`: each queued weight gradient computed and delivered, in the order queued."""
        for compute, weight, kept in self._queued.pop(key, ()):
            with torch.no_grad():  # as inside autograd's backward, where it was queued
                grad = compute()
            weight.backward(grad)
            for tensor in kept:
                self._count(tensor, -1)

    def _count(self, tensor: torch.Tensor, change: int) -> None:
        key = storage_key(tensor)
        entry = self._storages.setdefault(key, [tensor.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.held_bytes += entry[0]
        entry[1] += change
        if entry[1] == 0:
            self.held_bytes -= entry[0]
            del self._storages[key]

    def pending(self) -> list:
        return list(self._queued)


def _weight_grad_2d(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """autograd's weight gradient of F.linear over the flattened tokens, dy^T x, in the weight's own (row-major)
    layout as autograd makes it (`mm_mat2_backward` for a transposed operand). AccumulateGrad copies it (the caller
    still holds it), with a plain copy: the transposed view of x^T dy took a strided one, 13 ms of a 150 ms W pass
    on a stage of bench_pipeline's model against 3 ms now (the profiler's aten::copy_)."""
    return grad.reshape(-1, grad.size(-1)).t().mm(x.reshape(-1, x.size(-1)))


class _DeferringLinear(torch.autograd.Function):
    """y = x W^T + b whose weight gradient the store may defer."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.has_bias = store, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_input = grad.reshape(-1, grad.size(-1)).mm(weight).view(*grad.shape[:-1], weight.size(1))
        grad_bias = grad.reshape(-1, grad.size(-1)).sum(0) if ctx.has_bias else None
        if ctx.store.deferring is not None:
            ctx.store.put(lambda: _weight_grad_2d(x, grad), weight, (x, grad))
            return grad_input, None, grad_bias, None
        return grad_input, _weight_grad_2d(x, grad), grad_bias, None


def deferring_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     store: WeightGradStore) -> torch.Tensor:
    return _deferring_apply(x, weight, bias, store)


# eager under torch.compile (a graph break around it); an uncompiled run does not import the compiler (issue 47)
_deferring_apply = eager_under_compile(_DeferringLinear.apply)


def sequence_weight_grad(x: torch.Tensor, grad: torch.Tensor, group: CommGroup, gather) -> torch.Tensor:
    """The sequence-parallel linear's weight gradient: dy^T gather(x) (its input gathered again)."""
    full = gather(x, group)
    return grad.reshape(-1, grad.size(-1)).t().matmul(full.reshape(-1, full.size(-1)))
