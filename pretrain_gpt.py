"""Pretrain a GPT with Megatron-style tensor parallelism and data parallelism.

    torchrun --nproc_per_node 4 pretrain_gpt.py --tensor-model-parallel-size 2 \
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \
        --micro-batch-size 2 --global-batch-size 8 --train-iters 10 --lr 1e-4 \
        --mock-data --vocab-size 1000 --log-interval 1

Plain `python pretrain_gpt.py ...` runs as a world of one. `main(argv)` is the whole run, callable from
tests; it returns the per-iteration losses, gradient norms and learning rates, and the validation losses.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time

import torch
import torch.distributed as dist

from mpzero.checkpointing import load_checkpoint, save_checkpoint
from mpzero.arguments import adam_config, gpt_config, parse_args, precision_config, zero_config
from mpzero.data import build_gpt_datasets, build_tokenizer
from mpzero.errors import ConfigError, TrainingError
from mpzero.fused import resolved_impls
from mpzero.models import GPTModel
from mpzero.parallel import ParallelGroups, init_parallel
from mpzero.tensor_parallel import seed_everything
from mpzero.training.batches import load_batch, micro_batch_indices, num_micro_batches
from mpzero.training.console import iteration_line, model_flops_per_iteration, perplexity, validation_line
from mpzero.training.lr_schedule import schedule_from_args
from mpzero.training.memory import memory_per_rank
from mpzero.training.mock_data import MockGPTDataset
from mpzero.training.signals import TerminationSignal
from mpzero.training.tensorboard import TensorBoardLogger
from mpzero.zero import ZeroOptimizer


def main(argv: list[str] | None = None) -> dict:
    owns_world = not dist.is_initialized()  # else the caller (a test, a notebook) owns the process group
    try:
        return _pretrain(parse_args(argv))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except TrainingError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    except RuntimeError as error:
        if not _is_peer_failure(error):
            raise
        first_line = str(error).strip().splitlines()[0]
        print(f"error: a collective failed, a peer rank has died or timed out "
              f"(--distributed-timeout-minutes): {first_line[:300]}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        if owns_world and dist.is_initialized():
            dist.destroy_process_group()  # NCCL warns of leaked communicators otherwise


def _is_peer_failure(error: RuntimeError) -> bool:
    """c10d raises DistError for most failures, but a wait() on an async handle surfaces the backend's
    plain RuntimeError; recognize those by the backends' own words."""
    words = ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out", "NCCL error")
    return isinstance(error, dist.DistError) or any(w in str(error) for w in words)


def _pretrain(args) -> dict:
    groups = init_parallel(args.tensor_model_parallel_size, args.distributed_timeout_minutes)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * groups.dp_size
    num_micro_batches(args.global_batch_size, args.micro_batch_size, groups.dp_size)  # validates
    schedule = schedule_from_args(args)
    args.vocab_size = _vocab_size(args)
    train_data, valid_data, test_data = _datasets(args, groups)  # bad data paths fail before the model is built
    if groups.is_logging_rank:
        print("configuration: " + json.dumps(vars(args), sort_keys=True), flush=True)
        print("fused ops (auto): " + json.dumps(resolved_impls(groups.device), sort_keys=True), flush=True)
    rng = seed_everything(args.seed, groups.tp_rank, groups.device)
    model = GPTModel(gpt_config(args), groups.tp, rng, device=groups.device)
    optimizer = ZeroOptimizer(model, groups, zero_config(args), adam_config(args), precision_config(args))
    memory = optimizer.memory_report()
    if groups.is_logging_rank:
        print(memory.line(), flush=True)
    iteration, consumed, skipped = _load(args, model, optimizer, rng, groups, schedule)
    optimizer.comm_report()  # measure communication from the first iteration on
    tensorboard = TensorBoardLogger(args.tensorboard_dir, groups.is_logging_rank)
    termination = TerminationSignal(groups.world, groups.device)

    def save():
        if args.save:
            meta = {"consumed_samples": consumed, "skipped_iterations": skipped, "config": vars(args),
                    "lr_schedule": dataclasses.asdict(schedule)}
            where = save_checkpoint(args.save, iteration, model, optimizer, rng, groups, meta)
            if groups.is_logging_rank:
                print(f"saved checkpoint at iteration {iteration} to {where}", flush=True)

    history = {"losses": [], "grad_norms": [], "lrs": [], "valid_losses": []}
    interval = _new_interval()
    try:
        while iteration < args.train_iters:
            lr = schedule.lr(iteration - skipped)  # as in Megatron, skipped (fp16 overflow) steps do not count
            loss, stats = _train_step(model, optimizer, train_data, consumed, lr, args, groups)
            iteration, consumed, skipped = iteration + 1, consumed + args.global_batch_size, skipped + stats.skipped
            if not math.isfinite(loss):
                raise TrainingError(f"lm loss is {loss} at iteration {iteration} (rank {groups.world.rank}): "
                                    f"lower --lr or enable --clip-grad; the last checkpoint is intact")
            for key, value in (("losses", loss), ("grad_norms", stats.grad_norm), ("lrs", lr)):
                history[key].append(value)
            interval["iterations"] += 1
            interval["skipped"] += stats.skipped
            if not stats.skipped:
                interval["losses"].append(loss)
            if iteration % args.log_interval == 0:
                _log_interval(interval, iteration, consumed, lr, stats, args, groups, optimizer, tensorboard)
                interval = _new_interval()
            if args.eval_interval and iteration % args.eval_interval == 0 and valid_data is not None:
                history["valid_losses"].append(_evaluate_and_log(
                    model, valid_data, f"iteration {iteration}", iteration, args, groups, tensorboard))
            stop = termination.received_anywhere() or bool(args.exit_interval and iteration % args.exit_interval == 0)
            if stop or (args.save_interval and iteration % args.save_interval == 0) or iteration == args.train_iters:
                save()
            if stop:
                break
        if valid_data is not None:
            history["valid_losses"].append(_evaluate_and_log(
                model, valid_data, "the end of training for val data", iteration, args, groups, tensorboard))
        if test_data is not None:
            history["test_loss"] = _evaluate_and_log(model, test_data, "the end of training for test data",
                                                     iteration, args, groups, None)
    finally:
        termination.restore()
        tensorboard.close()
    return history


def _load(args, model, optimizer, rng, groups: ParallelGroups, schedule) -> tuple[int, int, int]:
    """(iteration, consumed samples, skipped iterations) to start from: zeros unless --load finds a
    checkpoint; --finetune takes its weights only and starts at zero."""
    if not args.load:
        return 0, 0, 0
    weights_only = args.finetune or args.no_load_optim
    meta = load_checkpoint(args.load, model, optimizer, rng, groups, load_optim=not weights_only,
                           load_rng=not (args.finetune or args.no_load_rng))
    if meta is None:
        if groups.is_logging_rank:
            print(f"note: no checkpoint in --load {args.load}; training from scratch", flush=True)
        return 0, 0, 0
    if groups.is_logging_rank:
        print(f"loaded checkpoint from {args.load} at iteration {meta['iteration']}", flush=True)
        saved_schedule = meta.get("lr_schedule")
        if saved_schedule and saved_schedule != dataclasses.asdict(schedule) and not args.finetune:
            print(f"note: the learning-rate schedule differs from the checkpoint's {saved_schedule}: "
                  f"continuing with this run's flags", flush=True)
    if args.finetune:
        return 0, 0, 0
    return meta["iteration"], meta["consumed_samples"], meta["skipped_iterations"]


def _datasets(args, groups: ParallelGroups):
    """(train, valid, test), sized for what the run reads: every evaluation reads the first
    --eval-iters global batches of its split. Mock data: three independent synthetic streams."""
    sizes = (args.train_iters * args.global_batch_size, args.eval_iters * args.global_batch_size,
             args.eval_iters * args.global_batch_size)
    if args.mock_data:
        return tuple(MockGPTDataset(args.vocab_size, args.seq_length, args.seed + k, n) if n else None
                     for k, n in enumerate(sizes))
    return tuple(build_gpt_datasets(args.data_path, args.split, args.seq_length, args.seed, sizes,
                                    args.data_cache_path, groups))


def _vocab_size(args) -> int:
    """The tokenizer's vocabulary (before padding for TP); --vocab-size for mock data."""
    if args.mock_data:
        return args.vocab_size
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file,
                                args.vocab_size)
    return tokenizer.vocab_size


def _train_step(model, optimizer, dataset, consumed, lr, args, groups: ParallelGroups):
    """One global batch: forward/backward every micro-batch, then one optimizer step.
    Returns the loss averaged over the global batch and the optimizer's StepStats."""
    model.train()
    optimizer.zero_grad()
    micro_batches = micro_batch_indices(consumed, args.global_batch_size, args.micro_batch_size,
                                        groups.dp_rank, groups.dp_size)
    total = torch.zeros((), device=groups.device)
    for i, indices in enumerate(micro_batches):
        tokens = load_batch(dataset, indices, groups.device)
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean() / len(micro_batches)
        optimizer.backward(loss, last_micro_batch=i == len(micro_batches) - 1)
        total += loss.detach()
    stats = optimizer.step(lr)
    groups.dp.all_reduce(total)
    return total.item() / groups.dp_size, stats


@torch.no_grad()
def evaluate(model, dataset, args, groups: ParallelGroups) -> float:
    """Mean lm loss over the first `--eval-iters` global batches of `dataset` (the same batches at every
    evaluation, so the curve shows the model changing, not the sample). Every rank runs every batch."""
    model.eval()
    total, batches = torch.zeros((), device=groups.device), 0
    for k in range(args.eval_iters):
        for indices in micro_batch_indices(k * args.global_batch_size, args.global_batch_size,
                                           args.micro_batch_size, groups.dp_rank, groups.dp_size):
            tokens = load_batch(dataset, indices, groups.device)
            total += model(tokens[:, :-1], tokens[:, 1:]).mean()
            batches += 1
    groups.dp.all_reduce(total)
    model.train()
    return total.item() / (batches * groups.dp_size)


def _evaluate_and_log(model, dataset, where, iteration, args, groups, tensorboard) -> float:
    loss = evaluate(model, dataset, args, groups)
    if groups.is_logging_rank:
        print(validation_line(where, loss), flush=True)
    if tensorboard is not None:
        tensorboard.scalars({"lm loss validation": loss, "lm loss validation ppl": perplexity(loss)}, iteration)
    return loss


def _new_interval() -> dict:
    return {"iterations": 0, "skipped": 0, "losses": [], "start": time.perf_counter()}


def _log_interval(interval, iteration, consumed, lr, stats, args, groups, optimizer, tensorboard):
    """Megatron's per-interval figures: time over all iterations, loss over the applied ones (0 when
    every step was skipped), skipped iterations counted since the previous line."""
    seconds = (time.perf_counter() - interval["start"]) / interval["iterations"]
    loss = sum(interval["losses"]) / max(len(interval["losses"]), 1)
    tokens_per_s = args.global_batch_size * args.seq_length / seconds
    flops = model_flops_per_iteration(args.num_layers, args.hidden_size, args.seq_length, args.vocab_size,
                                      args.global_batch_size, args.recompute_activations)
    tflops = flops / (seconds * groups.world.size * 1e12)
    memory = memory_per_rank(groups)  # every rank takes part in the gather
    comm = optimizer.comm_report()
    grad_norm = stats.grad_norm if stats.grad_norm is not None else float("nan")
    if groups.is_logging_rank:
        print(iteration_line(iteration, args.train_iters, consumed, seconds * 1000, lr, args.global_batch_size,
                             loss, stats.loss_scale, grad_norm, interval["skipped"], nan=0,
                             extra={"tokens/s": f"{tokens_per_s:.0f}", "TFLOP/s/rank": f"{tflops:.4f}"}),
              flush=True)
        print(comm.line(), flush=True)
    applied = {"lm loss": loss} if interval["losses"] else {}  # no point plotted for an all-skipped interval
    tensorboard.scalars({**applied, "learning-rate": lr, "grad-norm": grad_norm, "iteration-time": seconds,
                         "loss-scale": stats.loss_scale,
                         "batch-size": args.global_batch_size, "throughput": tokens_per_s,
                         **{f"mem-max-bytes/rank-{r}": b for r, b in enumerate(memory)}}, iteration)


if __name__ == "__main__":
    main()
