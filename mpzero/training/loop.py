"""The training loop, for any model: it takes a `RunConfig` (config.py) and a model provider (state.py), and never
looks at command-line flags or inside the model's own config section. `pretrain_gpt.py` is this loop plus a GPT
provider.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from functools import partial

from mpzero.activations import SavedBytesCounter, report_activation_memory
from mpzero.checkpointing import load_checkpoint, save_checkpoint
from mpzero.context_parallel import cp_comm_line
from mpzero.errors import TrainingError
from mpzero.moe import expert_biases, moe_log, restore_expert_biases, training_iteration
from mpzero.parallel import ParallelGroups
from mpzero.pipeline import in_flight_report
from mpzero.training.config import RunConfig
from mpzero.training.deferred import LaunchedSteps, launched_steps
from mpzero.training.console import iteration_line, perplexity, validation_line
from mpzero.training.memory import memory_per_rank
from mpzero.training.peak_flops import mfu_peak
from mpzero.training.profiling import IterationProfiler
from mpzero.training.signals import TerminationSignal
from mpzero.training.startup import start
from mpzero.training.metrics import MetricsLogger
from mpzero.training.passes import evaluate, forward_backward
from mpzero.training.state import ModelProvider, TrainingState, build_training_state, overlap_note, partition_note
from mpzero.zero import StepStats, ZeroOptimizer


@dataclass
class Progress:
    """Where the run stands: iterations done, samples consumed, iterations skipped (fp16 overflow); restored from
    a checkpoint, advanced by `train_step`, saved with every checkpoint."""
    iteration: int = 0
    consumed: int = 0
    skipped: int = 0


@dataclass
class Interval:
    """What the console line of one --log-interval sums: iterations, skipped ones, applied losses, since `start`."""
    iterations: int = 0
    skipped: int = 0
    losses: list[float] = field(default_factory=list)
    start: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class StepResult:
    loss: float  # the global batch's mean lm loss
    lr: float
    stats: StepStats
    terminated: bool  # SIGTERM reached some rank
    cp_bytes: float = 0.0  # sent on the CP group by this rank's forward and backward


def train(run: RunConfig, provider: ModelProvider) -> dict:
    """The whole run; returns per-iteration losses, gradient norms and learning rates, and validation losses.
    Each iteration is `train_step`, then the decisions: log, evaluate, save, stop."""
    groups = run.parallel.join()
    (train_data, valid_data, test_data), data_tokenizers = start(run, groups)
    state = _build_and_report(run, provider, groups)
    activations = SavedBytesCounter(state.model.module)  # watches the first micro-batch's forward
    progress = _load_or_close(run, state)
    state.optimizer.comm_report()  # measure communication from the first iteration on
    tensorboard = MetricsLogger(run.logging, groups.is_logging_rank, run.flags)  # TensorBoard and wandb
    termination = TerminationSignal(groups.world, groups.device)
    profiler = IterationProfiler(run.profile, groups.world.rank, run.logging.tensorboard_dir,
                                 groups.device.type == "cuda")
    profiler.note_resumed(progress.iteration)
    history = {"losses": [], "grad_norms": [], "lrs": [], "valid_losses": []}
    interval, terminated, first, launched = Interval(), False, True, launched_steps(run, state.optimizer)
    try:
        while progress.iteration < run.training.train_iters:
            profiler.before(progress.iteration)
            step = train_step(run, state, train_data, progress, termination, activations if first else None, launched)
            profiler.after(progress.iteration)
            iteration = progress.iteration
            for step in [step] if launched is None else launched.results_after(run, iteration, StepResult):
                terminated = _record(history, interval, step)
                progress.skipped += launched is not None and step.stats.skipped  # fp16 overflows, known at the read
            if first:
                _report_first_iteration(run, state, activations, tensorboard, iteration)
                first = False
            if iteration % run.logging.log_interval == 0:
                _log_interval(interval, progress, step, run, state, tensorboard)
                interval = Interval()
            if _should_evaluate(run, iteration) and valid_data is not None:
                history["valid_losses"].append(_evaluate_and_log(
                    state, valid_data, f"iteration {iteration}", iteration, run, tensorboard))
            stop = _should_stop(run, iteration, terminated)
            if _should_save(run, iteration, stop):
                save(run, state, progress, data_tokenizers)
            if stop:
                break
        state.optimizer.finish_update()  # --offload-delayed-update-after: the last update reaches the model
        if terminated:  # a scheduler's "save and leave now": no end-of-training evaluation in its grace period
            if groups.is_logging_rank:
                print(f"stopped by SIGTERM at iteration {progress.iteration}: skipping the end-of-training "
                      f"evaluation", flush=True)
            return history
        _final_evaluations(run, state, valid_data, test_data, progress.iteration, tensorboard, history)
    finally:
        profiler.close()
        termination.restore()
        tensorboard.close()
        state.optimizer.close()
    return history


def train_step(run: RunConfig, state: TrainingState, dataset, progress: Progress, termination: TerminationSignal,
               activations: SavedBytesCounter | None = None, pending: LaunchedSteps | None = None) -> StepResult | None:
    """One iteration: forward and backward of one global batch, the gradient check, the optimizer step; advances
    `progress`. Stops before the update, with the last checkpoint intact, on a non-finite loss (--check-for-nan)."""
    training, groups = run.training, state.groups
    # as in Megatron, skipped (fp16 overflow) steps do not count
    lr = run.schedule.lr(progress.iteration - progress.skipped)
    cp_mark = groups.cp.stats.total()
    micro_batches = training.global_batch_size // (training.micro_batch_size * groups.dp_size)
    with training_iteration(state.model.module, groups.ep, state.optimizer.loss_scale, micro_batches, groups.dp_cp):
        loss_sum = forward_backward(state, dataset, progress.consumed, training, activations)
    cp_bytes = groups.cp.stats.total() - cp_mark  # the CP attention's exchanges, forward and backward
    if pending is not None:  # launched with no host synchronisation, its result left for a later read
        # fp16: the device picks lrs[k] by the count k of the launched steps not yet read that it skipped
        lrs = [run.schedule.lr(progress.iteration - progress.skipped - k)
               for k in range(state.optimizer.unsettled_steps + 1)]
        progress.iteration, progress.consumed = progress.iteration + 1, progress.consumed + training.global_batch_size
        return pending.launch(state.optimizer, progress.iteration, lrs, loss_sum, termination.received_anywhere(),
                              cp_bytes)
    # The iteration's one device-to-host read: the gradient norm, with the loss and SIGTERM's flag
    check = state.optimizer.check_gradients(read_with=(loss_sum, termination.received_anywhere()))
    loss, terminated = check.read_with[0] / groups.dp_cp.size, bool(check.read_with[1])
    if training.check_for_nan and not math.isfinite(loss):  # before the update: nothing changed yet
        raise TrainingError(f"lm loss is {loss} at iteration {progress.iteration + 1} (rank {groups.world.rank}): "
                            f"stopped before the update, so the last checkpoint is intact; lower --lr or "
                            f"enable --clip-grad")
    stats = state.optimizer.step(lr)
    progress.iteration, progress.consumed = progress.iteration + 1, progress.consumed + training.global_batch_size
    progress.skipped += stats.skipped
    return StepResult(loss, lr, stats, terminated, cp_bytes)


def _should_evaluate(run: RunConfig, iteration: int) -> bool:
    eval_interval = run.evaluation.eval_interval
    return bool(eval_interval and iteration % eval_interval == 0)


def _should_stop(run: RunConfig, iteration: int, terminated: bool) -> bool:
    """SIGTERM, or --exit-interval's iteration."""
    exit_interval = run.training.exit_interval
    return terminated or bool(exit_interval and iteration % exit_interval == 0)


def _should_save(run: RunConfig, iteration: int, stop: bool) -> bool:
    """Before stopping, at every --save-interval and at the last iteration (`save` does nothing without --save)."""
    save_interval = run.checkpoint.save_interval
    return stop or bool(save_interval and iteration % save_interval == 0) or iteration == run.training.train_iters


def save(run: RunConfig, state: TrainingState, progress: Progress, data_tokenizers: dict) -> None:
    """A checkpoint of this iteration under --save, with the meta a resumed run reads; nothing without --save."""
    if not run.checkpoint.save:
        return
    state.optimizer.finish_update()  # --offload-delayed-update-after: the state is saved whole
    meta = {"consumed_samples": progress.consumed, "skipped_iterations": progress.skipped, "config": run.flags,
            "architecture": state.model.architecture, "lr_schedule": dataclasses.asdict(run.schedule)}
    if run.data.tokenizer is not None:
        meta["tokenizer"] = {**run.data.tokenizer, "data": data_tokenizers}
    biases = {name: bias for stage in state.groups.pp.all_gather_objects(expert_biases(state.model.module))
              for name, bias in stage.items()}  # every pipeline stage's routers
    if biases:
        meta["moe_expert_bias"] = biases
    where = save_checkpoint(run.checkpoint.save, progress.iteration, state.model.module, state.optimizer, state.rng,
                            state.groups, meta)
    if state.groups.is_logging_rank:
        print(f"saved checkpoint at iteration {progress.iteration} to {where}", flush=True)


def _build_and_report(run: RunConfig, provider: ModelProvider, groups: ParallelGroups) -> TrainingState:
    """The training state, and the lines said once it exists: the model-state memory and the notes."""
    state = build_training_state(run, provider, groups)
    directory = state.optimizer.offload_directory
    if directory is not None and directory.note:  # this rank removed a dead run's swap files
        print(directory.note, flush=True)
    lines = every_stage(groups, state.optimizer.memory_report().line())
    if groups.is_logging_rank:
        for line in lines:
            print(line, flush=True)
        for note in (overlap_note(state.optimizer), partition_note(state.optimizer)):
            if note:
                print(note, flush=True)
    return state


def every_stage(groups: ParallelGroups, line: str) -> list[str]:
    """A report line of this rank's, and under pipeline parallelism each stage's in its place, marked with the
    stage (a collective over the pipeline group: every rank calls it)."""
    if groups.pp_size == 1:
        return [line]
    head, rest = line.split(" | ", 1)
    return [f"{head} | pipeline stage {stage} | {body}"
            for stage, body in enumerate(groups.pp.all_gather_objects(rest))]


def _load_or_close(run: RunConfig, state: TrainingState) -> Progress:
    try:
        return Progress(*_load(run, state))
    except BaseException:  # a checkpoint refused: the offload files and their folder go all the same
        state.optimizer.close()
        raise


def _record(history: dict, interval: Interval, step: StepResult) -> bool:  # whether SIGTERM reached some rank
    for key, value in (("losses", step.loss), ("grad_norms", step.stats.grad_norm), ("lrs", step.lr)):
        history[key].append(value)
    interval.iterations += 1
    interval.skipped += step.stats.skipped
    if not step.stats.skipped:
        interval.losses.append(step.loss)
    return step.terminated


def _report_first_iteration(run: RunConfig, state: TrainingState, activations: SavedBytesCounter, tensorboard,
                            iteration: int) -> None:
    """After the first step: the in-step peak of a stage that reports one, and the `activation memory` lines,
    counted against the formula."""
    groups, training = state.groups, run.training
    memory = state.optimizer.memory_report()
    if memory.peak is not None and groups.is_logging_rank:
        print(memory.line(), flush=True)
    in_flight = None if state.pipeline is None else partial(in_flight_report, state.pipeline)
    report_activation_memory(activations, state.model.module, groups, training.micro_batch_size,
                             training.seq_length, run.precision.torch_dtype, tensorboard, iteration, in_flight)


def _final_evaluations(run: RunConfig, state: TrainingState, valid_data, test_data, iteration: int, tensorboard,
                       history: dict) -> None:
    if valid_data is not None:
        history["valid_losses"].append(_evaluate_and_log(
            state, valid_data, "the end of training for val data", iteration, run, tensorboard))
    if test_data is not None:
        history["test_loss"] = _evaluate_and_log(state, test_data, "the end of training for test data",
                                                 iteration, run, None)


def _load(run: RunConfig, state: TrainingState) -> tuple[int, int, int]:
    """(iteration, consumed samples, skipped iterations) to start from: zeros unless --load finds a
    checkpoint; --finetune takes its weights only and starts at zero."""
    checkpoint, groups = run.checkpoint, state.groups
    if not checkpoint.load:
        return 0, 0, 0
    meta = load_checkpoint(checkpoint.load, state.model.module, state.optimizer, state.rng, groups,
                           load_optim=checkpoint.load_optim, load_rng=checkpoint.load_rng,
                           architecture=state.model.architecture)
    if meta is None:
        if groups.is_logging_rank:
            print(f"note: no checkpoint in --load {checkpoint.load}; training from scratch", flush=True)
        return 0, 0, 0
    if groups.is_logging_rank:
        print(f"loaded checkpoint from {checkpoint.load} at iteration {meta['iteration']}", flush=True)
        saved_schedule = meta.get("lr_schedule")
        if saved_schedule and saved_schedule != dataclasses.asdict(run.schedule) and not checkpoint.finetune:
            print(f"note: the learning-rate schedule differs from the checkpoint's {saved_schedule}: "
                  f"continuing with this run's flags", flush=True)
    if checkpoint.finetune:
        return 0, 0, 0
    restore_expert_biases(state.model.module, meta.get("moe_expert_bias", {}), checkpoint.load)
    return meta["iteration"], meta["consumed_samples"], meta["skipped_iterations"]


def _evaluate_and_log(state: TrainingState, dataset, where: str, iteration: int, run: RunConfig,
                      tensorboard) -> float:
    state.optimizer.finish_update()  # --offload-delayed-update-after: evaluate the updated parameters
    evaluation = evaluate if state.pipeline is None else partial(state.pipeline.meter.uncounted, evaluate)
    loss = state.optimizer.uncounted(evaluation, state, dataset, run)  # the next comm lines: training's bytes
    if state.groups.is_logging_rank:
        print(validation_line(where, loss), flush=True)
    if tensorboard is not None:
        tensorboard.scalars({"lm loss validation": loss, "lm loss validation ppl": perplexity(loss)}, iteration)
    return loss


def _log_interval(interval: Interval, progress: Progress, step: StepResult, run: RunConfig, state: TrainingState,
                  tensorboard):
    """Megatron's per-interval figures: time over all iterations, loss over the applied ones (0 when
    every step was skipped), skipped iterations counted since the previous line."""
    groups, training = state.groups, run.training
    iteration, consumed, lr, stats = progress.iteration, progress.consumed, step.lr, step.stats
    seconds = (time.perf_counter() - interval.start) / interval.iterations
    loss = sum(interval.losses) / max(len(interval.losses), 1)
    tokens = training.global_batch_size * training.seq_length
    tokens_per_s = tokens / seconds
    tflops = state.model.flops_per_token * tokens / (seconds * groups.world.size * 1e12)
    memory = memory_per_rank(groups)  # every rank takes part in the gather
    comm = state.optimizer.comm_report()
    grad_norm = stats.grad_norm if stats.grad_norm is not None else float("nan")
    peak = mfu_peak(groups.device, run.precision.dtype)
    mfu = tflops / peak[1] if peak is not None and peak[1] is not None else None  # a known GPU, bf16/fp16
    comm_lines = every_stage(groups, comm.line())
    if state.pipeline is not None:
        comm_lines += groups.pp.all_gather_objects(state.pipeline.meter.report(iteration).line())
    if groups.cp.size > 1:  # the context-parallel attention's bytes of the last iteration, against theory
        micro_batches = training.global_batch_size // (training.micro_batch_size * groups.dp_size)
        comm_lines += every_stage(groups, cp_comm_line(
            run.model, groups.tp_size, training.micro_batch_size, training.seq_length,
            run.precision.torch_dtype.itemsize, micro_batches, step.cp_bytes, state.model.module.stage))
    moe_fields, moe_lines, moe_scalars = moe_log(state.model.module, groups.tp, groups.dp_cp, groups.pp, groups.ep,
                                                 groups.device)  # the MoE layers' losses and token counts
    if groups.is_logging_rank:
        extra = {"tokens/s": f"{tokens_per_s:.0f}", "TFLOP/s/rank": f"{tflops:.4f}",
                 **({} if mfu is None else {"MFU": f"{mfu:.3f}"}), **moe_fields}
        print(iteration_line(iteration, training.train_iters, consumed, seconds * 1000, lr,
                             training.global_batch_size, loss, stats.loss_scale, grad_norm, interval.skipped,
                             nan=0, extra=extra), flush=True)
        for line in comm_lines + moe_lines:
            print(line, flush=True)
    applied = {"lm loss": loss} if interval.losses else {}  # no point plotted for an all-skipped interval
    model_states = state.optimizer.memory_report()
    tensorboard.scalars({**applied, "learning-rate": lr, "grad-norm": grad_norm, "iteration-time": seconds,
                         "loss-scale": stats.loss_scale,
                         "batch-size": training.global_batch_size, "throughput": tokens_per_s,
                         **({} if mfu is None else {"mfu": mfu}),
                         **{f"mem-max-bytes/rank-{r}": b for r, b in enumerate(memory)},
                         "zero/memory-bytes": model_states.measured, "zero/memory-formula-bytes": model_states.formula,
                         "zero/comm-bytes-per-iter": comm.measured, "zero/comm-theory-bytes-per-iter": comm.theory,
                         **_offload_scalars(state.optimizer, comm), **moe_scalars}, iteration)


def _offload_scalars(optimizer: ZeroOptimizer, comm) -> dict[str, float]:
    """The offload tiers' bytes (this rank) and traffic per iteration, measured and by formula."""
    if not optimizer.offload.enabled:
        return {}
    scalars = {}
    for tier in optimizer.memory_report().tiers:
        key = tier.name.replace(" ", "-")
        scalars.update({f"offload/{key}-bytes": tier.measured, f"offload/{key}-formula-bytes": tier.formula})
    for transfer in comm.transfers:
        scalars.update({f"offload/{transfer.name}-bytes-per-iter": transfer.measured,
                        f"offload/{transfer.name}-theory-bytes-per-iter": transfer.theory})
    return scalars
