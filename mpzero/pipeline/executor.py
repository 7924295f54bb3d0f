"""Runs one rank's schedule (schedules.py) for one iteration: the model chunks' forwards and backwards, the
activations and their gradients sent and received between stages, ZeRO's backward windows around each backward.

Point-to-point batches are posted as the schedule lists them (`CommGroup.exchange`, counted) and waited for only
when a compute action needs what they receive; sends are waited for at the end of the iteration (a sent tensor
stays referenced until then). The stage that ends the model computes each micro-batch's mean loss divided by the
micro-batches, as one process does, multiplies it by the loss scale and runs its backward; every other stage runs
its backward from the gradient it receives, already scaled. A zero-bubble schedule's I runs the backward with
the linear layers' weight gradients deferred (`WeightGradStore`), W computes them; the window of the last backward
(or W) of the iteration is ZeRO's last micro-batch, where stages 0-1 reduce.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from mpzero.comm import CommGroup
from mpzero.pipeline.in_flight import HeldActivations
from mpzero.pipeline.schedules import COMM, Action, Pipeline, Step, peer
from mpzero.tensor_parallel import WeightGradStore
from mpzero.zero import scaled_loss

_TAGS = {"SEND_F": 0, "RECV_F": 0, "SEND_B": 1, "RECV_B": 1}  # activations and gradients apart (gloo matches tags)


class _Batch:
    """One posted batch's requests, waited for once (gloo's wait on a finished receive blocks forever) and the
    tensors it sends, referenced until then."""

    def __init__(self, requests: list, sent: list[torch.Tensor]):
        self.requests, self.sent = requests, sent

    def wait(self) -> None:
        for request in self.requests:
            request.wait()
        self.requests, self.sent = [], []


@dataclass(frozen=True)
class StageRun:
    """What one rank needs to run schedules: its model (all its chunks), the pipeline group, the shape and dtype of
    the hidden states that pass between stages, and the zero-bubble store (None without zero bubble)."""
    model: torch.nn.Module
    pp: CommGroup
    pipe: Pipeline
    shape: tuple[int, ...]  # [micro-batch, sequence /CP (/TP under sequence parallelism), hidden]
    dtype: torch.dtype
    device: torch.device
    store: WeightGradStore | None = None
    held: HeldActivations = field(default_factory=HeldActivations)  # a training iteration's held micro-batches


class _Iteration:
    """The tensors of one iteration, keyed by (chunk, micro-batch)."""

    def __init__(self, run: StageRun, rank: int):
        self.run, self.rank = run, rank
        self.inputs: dict = {}  # what each forward took (hidden states needing a gradient, or tokens)
        self.outputs: dict = {}  # what each forward returned (hidden states, or the loss)
        self.received: dict = {}  # (kind, key) -> (tensor, its _Batch)
        self.to_send: dict = {}  # (kind, key) -> tensor to send
        self.batches: list[_Batch] = []

    def post(self, step: Step) -> None:
        sends, recvs, pending = [], [], []
        for action in step:
            other, _ = peer(self.run.pipe, self.rank, action)
            key = (action.chunk, action.micro_batch)
            if action.kind.startswith("SEND"):
                sends.append((self.to_send.pop((action.kind, key)), other))
            else:
                buffer = torch.empty(self.run.shape, dtype=self.run.dtype, device=self.run.device)
                recvs.append((buffer, other))
                pending.append((action.kind, key, buffer))
        requests = self.run.pp.exchange(sends, recvs, async_op=True, tags=[_TAGS[a.kind] for a in step])
        batch = _Batch(requests, [tensor for tensor, _ in sends])
        for kind, key, buffer in pending:
            self.received[kind, key] = (buffer, batch)
        self.batches.append(batch)

    def wait_for(self, action: Action) -> None:
        """Wait for what a compute action receives (before it is timed: waiting is idle time, not compute)."""
        kind = "RECV_F" if action.kind == "F" else "RECV_B"
        pending = self.received.get((kind, (action.chunk, action.micro_batch)))
        if pending is not None:
            pending[1].wait()

    def take(self, kind: str, key) -> torch.Tensor:
        buffer, batch = self.received.pop((kind, key))
        batch.wait()
        return buffer

    def finish(self) -> None:
        for batch in self.batches:
            batch.wait()
        self.batches = []


def run_schedule(run: StageRun, steps: list[Step], rank: int, tokens: Callable[[int], torch.Tensor],
                 labels: Callable[[int], torch.Tensor], optimizer=None, counting=None,
                 timings: dict | None = None) -> torch.Tensor:
    """One iteration of `steps` on this rank; returns the sum of the micro-batches' losses (each the mean over
    its tokens, divided by m when training) on the stage that ends the model, zero elsewhere, as a device scalar.
    `tokens(mb)` / `labels(mb)`: a micro-batch's inputs and labels (asked only where the model begins / ends). Without an
    optimizer (evaluation) the schedule holds forwards only. `counting(chunk, mb)`: a context manager around each
    forward (activation counting), or None. `timings`: {kind: [seconds of each action]} appended to, on the host
    clock (bench/bench_pipeline.py: a CPU run, where the host waits for every op): the compute kinds, "post" (a
    batch of sends and receives posted) and "wait" (for what a compute action receives)."""
    it, pipe, stage = _Iteration(run, rank), run.pipe, run.model.stage
    total = torch.zeros((), device=run.device)
    last = _last_backward(steps)
    held = run.held if optimizer is not None else None  # counted while training (pipeline/in_flight.py)
    if held is not None:
        held.reset(pipe.v)
    for index, step in enumerate(steps):
        action = step[0]
        if action.kind in COMM:
            posted = time.perf_counter()
            it.post(step)
            _record(timings, "post", posted)
            continue
        key = (action.chunk, action.micro_batch)
        waited = time.perf_counter()
        it.wait_for(action)
        _record(timings, "wait", waited)
        started = time.perf_counter()
        if action.kind == "F":
            loss = _forward(it, key, stage, tokens, labels, counting, pipe.m, optimizer is not None)
            if loss is not None:
                total += loss.detach()
        elif action.kind in ("B", "I"):
            _backward(it, action, key, stage, optimizer, index == last)
        else:  # W
            with optimizer.backward_window(index == last, micro_batch=False):
                run.store.run(key)
        if held is not None:
            held.step(action.kind, action.chunk, run.store.held_bytes if run.store is not None else 0)
        _record(timings, action.kind, started)
    it.finish()
    return total


def _record(timings: dict | None, kind: str, started: float) -> None:
    if timings is not None:
        timings.setdefault(kind, []).append(time.perf_counter() - started)


def _last_backward(steps: list[Step]) -> int:
    kinds = ("B", "I", "W")
    return max((i for i, step in enumerate(steps) if step[0].kind in kinds), default=-1)


def _forward(it: _Iteration, key, stage, tokens, labels, counting, m: int, train: bool):
    """The micro-batch through the chunk; keeps what its backward needs (training); returns its loss where the
    chunk ends the model, else queues its output for sending."""
    chunk, mb = key
    if stage.begins(chunk):
        x = tokens(mb)
    else:
        x = it.take("RECV_F", key).requires_grad_(train)
    with counting(chunk, mb) if counting is not None else contextlib.nullcontext():
        out = it.run.model(x, labels(mb) if stage.ends(chunk) else None, chunk=chunk)
    loss = (out.mean() / m if train else out.mean()) if stage.ends(chunk) else None
    if train:
        it.inputs[key], it.outputs[key] = x, (out if loss is None else loss)
    if loss is None:
        it.to_send["SEND_F", key] = out.detach()
    return loss


def _backward(it: _Iteration, action: Action, key, stage, optimizer, last: bool) -> None:
    chunk, _ = key
    output, x = it.outputs.pop(key), it.inputs.pop(key)
    grad = None if stage.ends(chunk) else it.take("RECV_B", key)
    deferring = it.run.store.defer(key) if action.kind == "I" else contextlib.nullcontext()
    # one micro-batch for ZeRO's count: its backward through chunk 0, the last of its chunks on this rank
    with optimizer.backward_window(last, micro_batch=chunk == 0) as scale, deferring:
        if grad is None:
            scaled_loss(output, scale).backward()
        else:
            torch.autograd.backward(output, grad)
    if not stage.begins(chunk):
        it.to_send["SEND_B", key] = x.grad
