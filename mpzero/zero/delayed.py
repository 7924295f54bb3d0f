"""ZeRO-Offload's one-step delayed parameter update (DPU, Ren et al. 2021 §5.2; `--offload-delayed-update-after N`):
after N ordinary steps, the CPU step of iteration i runs in a background thread while iteration i+1's forward and
backward run, so iteration i+1 computes its gradients at the parameters before iteration i's update.

What it equals, exactly (tests/test_delayed_update.py): with w_0 the initial weights and w_i = step(w_{i-1}, g_i),
iteration i's gradients g_i are taken at w_{i-1} for i <= N + 1 and at w_{i-2} after; the masters and the rule's
states follow w_i in order, as without the delay. So the last update is pending when the loop ends, or before a
checkpoint or an evaluation: `finish()` applies it there (the next iteration then starts from the updated
parameters, like a warm-up step).

How: the front checks and clips the gradients on the calling thread (the step's one synchronisation; fp16's overflow
skip is decided there too, so it stays consistent: a skipped iteration starts no update and the pending one is
applied as usual), snapshots them into host memory (the next backward zeroes and refills the buffers: + gP/N host
bytes), and hands the store a `DeferredSink`: the new parameter values are kept on the host and written to the
stage's real sink only when the next step (or `finish()`) joins the thread, after which the stage spreads them
(all-gather, release) on the calling thread, as every collective must. The store is used by that one thread at a
time. This changes the numerics (it is the paper's algorithm), so it is opt-in.
"""

from __future__ import annotations

import threading

import torch

from mpzero.zero.tiers import ParamSink
from mpzero.zero.step_grads import FileGrads, Fp32Buckets


class DeferredSink(ParamSink):
    """Keeps every parameter write of a step (a copy: the store reuses its staging buffer) for `replay()` into the
    real sink later; nothing reaches the model meanwhile."""

    def __init__(self, sink: ParamSink):
        self.real, self.dtype, self.device = sink, sink.dtype, sink.device
        self._writes: list[tuple[int, int, torch.Tensor]] = []

    def write(self, bucket: int, start: int, values: torch.Tensor) -> None:
        self._writes.append((bucket, start, values.to(self.dtype, copy=True)))

    def flush(self) -> None:
        pass  # the copies are made in write()

    def transfers(self):
        return self.real.transfers()  # the store counts through its sink, deferred or not

    def replay(self) -> None:
        """The kept values into the real sink, in the order they were written, then flushed."""
        for bucket, start, values in self._writes:
            self.real.write(bucket, start, values)
        self.real.flush()
        self._writes = []


def snapshot(grads):
    """The step's fp32 gradients (or `Fp32Buckets` over low-precision ones) copied to host memory, unscaled and
    clipped as they are, so that the next backward may refill the buffers."""
    if isinstance(grads, FileGrads):  # on disk: read into host memory (the next backward rewrites the file)
        return grads.host_copies()
    if isinstance(grads, Fp32Buckets):
        copy = Fp32Buckets([shard.to("cpu", copy=True) for shard in grads.shards], grads.inverse_scale)
        if grads._coef is not None:
            copy.clip_(grads._coef)
        return copy
    return [grad.to("cpu", copy=True) for grad in grads]


class DelayedUpdate:
    """The store's step of one iteration in a background thread, its parameter writes deferred until `finish()`."""

    def __init__(self, masters, stage):
        self.masters, self.stage = masters, stage
        self._thread: threading.Thread | None = None
        self._sink: DeferredSink | None = None
        self._error: BaseException | None = None
        self.fp32_peak = 0  # the largest fp32 working set of a background step (low-precision gradients)

    @property
    def pending(self) -> bool:
        return self._thread is not None

    def start(self, grads, lr: float) -> None:
        """Iteration i's update from its (checked, clipped) gradients, in the background."""
        assert self._thread is None, "finish() the pending update first"
        grads = snapshot(grads)
        self._sink = DeferredSink(self.masters.sink)
        self.masters.sink, self._error = self._sink, None  # until finish(): the store writes to the host copies

        def run():
            try:
                self.masters.step(grads, lr)
            except BaseException as error:  # noqa: BLE001 - re-raised on the calling thread by finish()
                self._error = error
            finally:
                if isinstance(grads, Fp32Buckets):
                    grads.release()
                    self.fp32_peak = max(self.fp32_peak, grads.meter.peak)

        self._thread = threading.Thread(target=run, name="mpzero-delayed-update", daemon=True)
        self._thread.start()

    def finish(self) -> bool:
        """Wait for the pending update, write its parameters and let the stage spread them; False if none."""
        if self._thread is None:
            return False
        self._thread.join()
        self._thread = None
        self.masters.sink = self._sink.real
        if self._error is not None:
            error, self._error, self._sink = self._error, None, None
            raise error
        self._sink.replay()
        self._sink = None
        self.stage.after_update()
        return True
