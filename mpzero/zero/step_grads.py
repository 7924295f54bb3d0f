"""The optimizer step's fp32 view of this rank's gradient shards: unscaled, clipped, cast a piece at a time.

AdamW updates fp32 masters with fp32 gradients. When the gradient buffers are fp32 (fp32 runs, and bf16 with
Megatron's default --accumulate-allreduce-grads-in-fp32) the step works on them in place: unscaled and clipped
where they lie, no copy. When they are in the parameters' dtype (fp16, bf16 with --grad-reduce-in-bf16),
`Fp32Buckets` casts them on demand: a piece is cast, unscaled (x 1/loss scale) and clipped (x the clipping
coefficient, once the norm is known) when the step first reads it, in that order, the same arithmetic elementwise
as casting every shard at once, so the result is bitwise that of the whole cast. The norm reads the
low-precision shards themselves (`grad_norm_squared(..., scale=)` casts chunk by chunk).

Two readers, each with a bounded fp32 working set (issue 24, item 2), counted by `meter`:
- the in-memory step (`DeviceMasters`) reads whole buckets, `buckets[b]`: one bucket's shard at a time,
  4 x the largest shard (`accounting.step_fp32_bytes`);
- an offloaded optimizer reads sub-groups, `buckets.piece(b, lo, hi)`: the pieces of the sub-group it updates
  and of the one whose gradients are on their way to the host, at most `PIECES_KEPT` pieces, each inside one
  sub-group of G elements: 4 x 2G, whatever the model size.

`FileGrads` is the same reader over gradients on disk (offload/grad_file.py): the pieces come from the bucket's
region, read back in bucket order (the next one read ahead); fp32 gradients are unscaled and clipped in place in
the region buffer, low-precision ones cast as above.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpzero.zero.meter import TransientMeter

PIECES_KEPT = 2  # fp32 pieces alive at once for an offloaded optimizer: the sub-group updated and one in flight


class Fp32Buckets(Sequence):
    """Per bucket, this rank's gradient shard as fp32, unscaled and clipped (see the module docstring)."""

    def __init__(self, shards: list[torch.Tensor], inverse_scale: float):
        self.shards, self.inverse_scale = shards, inverse_scale
        self._coef: float | None = None
        self._cast: dict[tuple[int, int, int], torch.Tensor] = {}  # (bucket, lo, hi) -> fp32 copy, oldest first
        self._read = False
        self.meter = TransientMeter()  # fp32 bytes alive: the step's working set

    def clip_(self, coef: float) -> None:
        """Multiply every gradient by `coef` (before any piece is read)."""
        if self._read:
            raise RuntimeError("clip_() after a bucket was read: its fp32 copy is already final")
        self._coef = coef

    def __len__(self) -> int:
        return len(self.shards)

    @property
    def device(self) -> torch.device:
        """Where the gradients are (the fp32 pieces are made there)."""
        return self.shards[0].device if self.shards else torch.device("cpu")

    def _shard(self, bucket: int) -> torch.Tensor:
        return self.shards[bucket]

    def __getitem__(self, bucket: int) -> torch.Tensor:
        """Bucket's whole shard in fp32; the previous bucket's copy is dropped first (one at a time)."""
        key = (bucket, 0, self.shards[bucket].numel())
        if key not in self._cast:
            self.release()
        return self._get(key)

    def piece(self, bucket: int, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of bucket's shard in fp32; at most PIECES_KEPT pieces stay alive (oldest dropped)."""
        key = (bucket, lo, hi)
        if key not in self._cast:
            while len(self._cast) >= PIECES_KEPT:
                self._drop(next(iter(self._cast)))
        return self._get(key)

    def _get(self, key: tuple[int, int, int]) -> torch.Tensor:
        if key not in self._cast:
            bucket, lo, hi = key
            grad = self._shard(bucket)[lo:hi].float()  # fp32 (on disk): the region buffer's elements, in place
            if isinstance(self.inverse_scale, torch.Tensor) or self.inverse_scale != 1.0:  # a tensor: not read
                grad.mul_(self.inverse_scale)
            if self._coef is not None:
                grad.mul_(self._coef)
            self._cast[key] = grad
            self._read = True
            self.meter.add(self._copy_bytes(key))
        return self._cast[key]

    def _copy_bytes(self, key: tuple[int, int, int]) -> int:
        """fp32 bytes the piece holds beyond its source: none for fp32 gradients (a view, changed in place)."""
        return 0 if self._source_dtype(key[0]) == torch.float32 else self._cast[key].nbytes

    def _drop(self, key: tuple[int, int, int]) -> None:
        self.meter.sub(self._copy_bytes(key))
        del self._cast[key]

    def _source_dtype(self, bucket: int) -> torch.dtype:
        return self.shards[bucket].dtype

    def release(self) -> None:
        """Drop every fp32 copy (the step is over, or moves to another bucket)."""
        for key in list(self._cast):
            self._drop(key)


class FileGrads(Fp32Buckets):
    """This rank's gradient slices on disk (`GradFile`), read by an offloaded optimizer's step piece by piece, in
    bucket order (see the module docstring). `release()` ends the step's reads."""

    def __init__(self, file, inverse_scale: float):
        super().__init__([], inverse_scale)
        self.file = file
        self._reader = file.reader()
        self._bucket: int | None = None

    def __len__(self) -> int:
        return len(self.file.numels)

    def __getitem__(self, bucket: int) -> torch.Tensor:
        raise TypeError("gradients on disk are read by pieces (piece(bucket, lo, hi)), by an offloaded optimizer")

    def _shard(self, bucket: int) -> torch.Tensor:
        if bucket != self._bucket:  # the reader reuses the buffer of the bucket before: its pieces go first
            for key in [key for key in self._cast if key[0] != bucket]:
                self._drop(key)
            self._bucket = bucket
        return self._reader.slice(bucket)

    def _source_dtype(self, bucket: int) -> torch.dtype:
        return self.file.dtype

    def release(self) -> None:
        super().release()
        self._bucket = None
        self._reader.wait()

    def host_copies(self) -> Fp32Buckets:
        """The gradients read into host memory (g P/N bytes), as an `Fp32Buckets` unscaled and clipped like these:
        the delayed update's snapshot, which the next backward must not overwrite."""
        self._reader.wait()
        copies = [self.file.read(b, self.file.buffers[0]).clone() for b in range(len(self))]
        copy = Fp32Buckets(copies, self.inverse_scale)
        if self._coef is not None:
            copy.clip_(self._coef)
        return copy
