"""The optimizer step's fp32 view of this rank's gradient shards: unscaled, clipped, cast one bucket at a time.

AdamW updates fp32 masters with fp32 gradients. When the gradient buffers are fp32 (fp32 runs, and bf16 with
Megatron's default --accumulate-allreduce-grads-in-fp32) the step works on them in place: unscaled and clipped
where they lie, no copy. When they are in the parameters' dtype (fp16, bf16 with --grad-reduce-in-bf16),
`Fp32Buckets` casts them on demand: bucket b is cast, unscaled (x 1/loss scale) and clipped (x the clipping
coefficient, once the norm is known) when the step first reads it, in that order, the same arithmetic as casting
every shard at once; the fp32 copy of the previous bucket is dropped, so the step's fp32 working set is one
bucket's shard (4 x its elements), not 4P/N. The norm reads the low-precision shards themselves
(`grad_norm_squared(..., scale=)` casts chunk by chunk). An offloaded optimizer copies gradients to the host on a
side stream, ahead of the bucket it updates: it gets every bucket cast at once (`keep_all`, 4P/N as before;
issue 24 streams them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Fp32Buckets(Sequence):
    """Per bucket, this rank's gradient shard as fp32, unscaled and clipped (see the module docstring)."""

    def __init__(self, shards: list[torch.Tensor], inverse_scale: float, keep_all: bool):
        self.shards, self.inverse_scale, self._keep_all = shards, inverse_scale, keep_all
        self._coef: float | None = None
        self._cast: dict[int, torch.Tensor] = {}

    def clip_(self, coef: float) -> None:
        """Multiply every gradient by `coef` (before any bucket is read)."""
        if self._cast:
            raise RuntimeError("clip_() after a bucket was read: its fp32 copy is already final")
        self._coef = coef

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, bucket: int) -> torch.Tensor:
        if bucket not in self._cast:
            if not self._keep_all:
                self._cast.clear()  # at most one fp32 bucket at a time
            grad = self.shards[bucket].float()
            if self.inverse_scale != 1.0:
                grad.mul_(self.inverse_scale)
            if self._coef is not None:
                grad.mul_(self._coef)
            self._cast[bucket] = grad
        return self._cast[bucket]
