"""Pretrain a GPT with Megatron-style tensor parallelism and data parallelism.

    torchrun --nproc_per_node 4 pretrain_gpt.py --tensor-model-parallel-size 2 \
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \
        --micro-batch-size 2 --global-batch-size 8 --train-iters 10 --lr 1e-4 \
        --mock-data --vocab-size 1000 --log-interval 1

Plain `python pretrain_gpt.py ...` runs as a world of one. `main(argv)` is the whole run, callable from
tests; it returns the per-iteration losses, gradient norms and learning rates, and the validation losses.

This file is the GPT-specific part: the flags are turned into a checked `RunConfig` (mpzero/cli/arguments.py)
before anything is printed, and `gpt_provider` builds the model; the loop (mpzero/training/loop.py) is
model-agnostic. A second model family is another provider (and its flags), not another loop.
"""

from __future__ import annotations

import functools

import torch.distributed as dist

from mpzero.cli import print_error, run_or_exit
from mpzero.cli.arguments import parse_args, run_config
from mpzero.errors import ConfigError, TrainingError
from mpzero.launcher_env import launcher_env
from mpzero.models import GPTConfig, family_of
from mpzero.parallel import ParallelGroups
from mpzero.pipeline import PipelineConfig, stage_layers
from mpzero.tensor_parallel import RNGStatesTracker
from mpzero.training import BuiltModel, train


def gpt_provider(config: GPTConfig, groups: ParallelGroups, rng: RNGStatesTracker,
                 micro_batch_size: int = 1, pipeline: PipelineConfig = PipelineConfig()) -> BuiltModel:
    """The model without storage: ZeroOptimizer makes it one unit or bucket at a time, straight into this rank's
    shard (streamed construction: no rank holds the fp32 model; the same weights as a whole build). A pipeline
    rank builds its stage alone (`pipeline`'s layer split): the same names, so the same weights, as in one
    process. Its FLOPs per token are the whole model's, of a micro-batch of `micro_batch_size` sequences (the
    chunked loss recomputes all but the last chunk of one)."""
    family = family_of(config)
    stage = stage_layers(pipeline, config.num_layers)[groups.pp_rank] if groups.pp_size > 1 else None
    model = family.build(config, groups.tp, rng, device="meta", stage=stage, cp=groups.cp, ep=groups.ep,
                         expert_tp=groups.expert_tp)
    return BuiltModel(model, family.flops_per_token(config, groups.tp_size, micro_batch_size),
                      family.architecture(config))


def main(argv: list[str] | None = None) -> dict:
    owns_world = not dist.is_initialized()  # else the caller (a test, a notebook) owns the process group
    try:
        run = _validated_run(argv)
        if run.dry_run is not None:  # one rank of a --world-size job on fake tensors (mpzero/cli/dry_run.py)
            from mpzero.cli.dry_run import dry_run
            return run_or_exit(lambda: dry_run(run, _provider(run), run.dry_run.world_size, run.dry_run.rank))
        return run_or_exit(lambda: _train_reporting_peer_failures(run))
    finally:
        if owns_world and dist.is_initialized():
            dist.destroy_process_group()  # NCCL warns of leaked communicators otherwise


def _provider(run):
    return functools.partial(gpt_provider, micro_batch_size=run.training.micro_batch_size, pipeline=run.pipeline)


def _validated_run(argv):
    """The checked RunConfig, before any output. A bad flag is the same error on every rank: only global
    rank 0 prints it, once; every rank exits 2."""
    try:  # the launcher's variables first: each process has its own, so each says what is wrong with its own
        env = launcher_env()
    except ConfigError as error:
        print_error(error)
        raise SystemExit(2) from None
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (env.rank,
                                                                                                env.world_size)
    try:
        args = parse_args(argv)
        if args.dry_run or args.world_size is not None or args.rank is not None:
            from mpzero.cli.dry_run import check_flags
            check_flags(args)
            if args.dry_run:  # this process is the whole (simulated) job: it prints its own errors
                rank, world_size = 0, args.world_size or 1
        return run_config(args, world_size)
    except ConfigError as error:
        if rank == 0:
            print_error(error)
        raise SystemExit(2) from None


def _train_reporting_peer_failures(run) -> dict:
    try:
        return train(run, _provider(run))
    except RuntimeError as error:
        if isinstance(error, TrainingError) or not _is_peer_failure(error):
            raise
        first_line = str(error).strip().splitlines()[0]
        print_error(f"a collective failed, a peer rank has died or timed out "
                    f"(--distributed-timeout-minutes): {first_line[:300]}")
        raise SystemExit(1) from None


def _is_peer_failure(error: RuntimeError) -> bool:
    """c10d raises DistError for most failures, but a wait() on an async handle surfaces the backend's
    plain RuntimeError; recognize those by the backends' own words."""
    words = ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out", "NCCL error")
    return isinstance(error, dist.DistError) or any(w in str(error) for w in words)


if __name__ == "__main__":
    main()
