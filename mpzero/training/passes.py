"""One global batch through the model: `forward_backward` (training: every micro-batch's forward and backward, one
process or this rank's pipeline schedule) and `evaluate` (the mean loss over the validation batches)."""

from __future__ import annotations

import contextlib

import torch

from mpzero.activations import SavedBytesCounter
from mpzero.pipeline import run_schedule
from mpzero.training.batches import MicroBatches, inputs_and_labels, micro_batch_indices
from mpzero.training.config import RunConfig
from mpzero.training.state import TrainingState
from mpzero.zero import ZeroOptimizer


def forward_backward(state: TrainingState, dataset, consumed: int, training,
                      activations: SavedBytesCounter | None = None) -> torch.Tensor:
    """Forward and backward of every micro-batch of one global batch; returns the global batch's loss times the
    DP x CP size (the DP and CP ranks' mean losses summed, each over as many tokens; the same on every rank) as a
    device scalar, not read here: the caller divides it by that size on the host once it reads it. The optimizer
    step is the caller's.
    `activations`: counts what the first micro-batch's forward saves for backward (it only looks)."""
    model, optimizer, groups = state.model.module, state.optimizer, state.groups
    model.train()
    optimizer.zero_grad()
    micro_batches = micro_batch_indices(consumed, training.global_batch_size, training.micro_batch_size,
                                        groups.dp_rank, groups.dp_size)
    if state.pipeline is not None:
        batches = MicroBatches(dataset, micro_batches, groups.device, groups.cp)
        return _pipeline_losses(state, batches, activations, optimizer)
    total = torch.zeros((), device=groups.device)
    for i, indices in enumerate(micro_batches):
        inputs, labels = inputs_and_labels(dataset, indices, groups.device, groups.cp)
        with activations.counting() if activations is not None and i == 0 else contextlib.nullcontext():
            loss = model(inputs, labels).mean() / len(micro_batches)
        optimizer.backward(loss, last_micro_batch=i == len(micro_batches) - 1)
        total += loss.detach()
    _sum_over_data_parallel(total, groups, optimizer)
    return total


def _pipeline_losses(state: TrainingState, batches: MicroBatches, activations: SavedBytesCounter | None,
                     optimizer: ZeroOptimizer | None) -> torch.Tensor:
    """One iteration of this rank's pipeline schedule (training with an optimizer, else evaluation); the loss the
    last stage computed, summed over DP x CP and given to every stage (the NaN check and the log see it anywhere).
    The activation counter watches each model chunk's first micro-batch."""
    schedule, groups = state.pipeline, state.groups

    def counting(chunk: int, micro_batch: int):
        return activations.counting() if activations is not None and micro_batch == 0 else contextlib.nullcontext()

    steps = schedule.train_steps if optimizer is not None else schedule.eval_steps
    total = run_schedule(schedule.run, steps, schedule.rank, batches.tokens, batches.labels, optimizer, counting)
    _sum_over_data_parallel(total, groups, optimizer)
    groups.pp.all_reduce(total)
    return total


def _sum_over_data_parallel(total: torch.Tensor, groups, optimizer: ZeroOptimizer | None) -> None:
    """The loss summed over DP x CP, in place; a scalar for the log, so left out of the `zero comm` line, which
    states ZeRO's own traffic (an evaluation is left out whole, by the loop)."""
    if optimizer is None:
        groups.dp_cp.all_reduce(total)
    else:
        optimizer.uncounted(groups.dp_cp.all_reduce, total)




@torch.no_grad()
def evaluate(state: TrainingState, dataset, run: RunConfig) -> float:
    """Mean lm loss over the first `--eval-iters` global batches of `dataset` (the same batches at every
    evaluation, so the curve shows the model changing, not the sample). Every rank runs every batch."""
    model, groups, training = state.model.module, state.groups, run.training
    model.eval()
    total, batches = torch.zeros((), device=groups.device), 0
    for k in range(run.evaluation.eval_iters):
        indices = micro_batch_indices(k * training.global_batch_size, training.global_batch_size,
                                      training.micro_batch_size, groups.dp_rank, groups.dp_size)
        if state.pipeline is not None:  # the micro-batches' mean losses, summed over DP x CP and given to every stage
            total += _pipeline_losses(state, MicroBatches(dataset, indices, groups.device, groups.cp), None, None)
        else:
            for micro_batch in indices:
                total += model(*inputs_and_labels(dataset, micro_batch, groups.device, groups.cp)).mean()
        batches += len(indices)
    if state.pipeline is None:
        groups.dp_cp.all_reduce(total)
    model.train()
    return total.item() / (batches * groups.dp_cp.size)
