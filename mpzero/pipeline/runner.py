"""What the training loop holds for a pipeline rank: its `StageRun` and its steps for training and for evaluation,
built once per run (the micro-batches per iteration are fixed), with the zero-bubble store given to the
transformer layers' tensor-parallel linears when the schedule splits backwards."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from mpzero.comm import CommGroup
from mpzero.comm_shm import open_shared_memory_p2p
from mpzero.parallel import ParallelGroups
from mpzero.pipeline.accounting import PipelineMeter
from mpzero.pipeline.config import PipelineConfig
from mpzero.pipeline.executor import StageRun
from mpzero.pipeline.schedules import Step, build
from mpzero.tensor_parallel import ColumnParallelLinear, RowParallelLinear, WeightGradStore


@dataclass(frozen=True)
class PipelineSchedule:
    run: StageRun
    train_steps: list[Step]
    eval_steps: list[Step]
    rank: int
    kind: str  # the schedule's name (schedules.SCHEDULES)
    meter: PipelineMeter


def pipeline_schedule(config: PipelineConfig, groups: ParallelGroups, model, micro_batch_size: int,
                      seq_length: int, micro_batches: int, dtype: torch.dtype, tied_bytes: int = 0,
                      p2p_timeout: float | None = None) -> PipelineSchedule:
    """This rank's schedules for a model built from `config`'s stage (a GPTModel: its config gives the hidden
    states' shape, [b, s/CP, h], or [b, s/CP/t, h] under sequence parallelism: a context-parallel rank's tokens).
    `tied_bytes`: this rank's slice of the tied embedding's gradient, all-reduced with the other end's
    (`ZeroOptimizer.tied_gradient_bytes`). `p2p_timeout`: seconds; given (a real run, not a dry run), CPU ranks of
    one host exchange through shared memory (`comm_shm`) failing after it, as the process groups do."""
    store = None
    if config.zero_bubble:
        store = WeightGradStore()
        for module in model.layers.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.weight_grad_store = store
    model_config = model.config
    seq = seq_length // groups.cp.size
    seq = seq // groups.tp_size if model_config.sequence_parallel else seq
    pipe = config.pipe(micro_batches)
    activation_bytes = micro_batch_size * seq * model_config.hidden_size * dtype.itemsize
    pp = _point_to_point(groups, activation_bytes, p2p_timeout)
    run = StageRun(model, pp, pipe, (micro_batch_size, seq, model_config.hidden_size), dtype, groups.device,
                   store)
    rank = groups.pp_rank
    # NCCL's batched point-to-point needs every rank of the group in the group's first collective
    groups.pp.all_reduce(torch.zeros(1, device=groups.device))
    meter = PipelineMeter(groups.pp, groups.embedding, config.schedule, pipe, rank, activation_bytes, tied_bytes)
    return PipelineSchedule(run, build(config.schedule, pipe)[rank], build("forward", pipe)[rank], rank,
                            config.schedule, meter)


def _point_to_point(groups: ParallelGroups, nbytes: int, timeout: float | None) -> CommGroup:
    """The pipeline group, exchanging through shared memory where its ranks compute on one host's CPU (gloo's
    loopback costs each message its I/O threads' turn on busy cores); its byte counter is the group's own."""
    if timeout is None or groups.device.type != "cpu" or groups.pp.size == 1:
        return groups.pp
    rank, size = groups.pp.rank, groups.pp.size  # a stage sends to the next and back (the last to the first: v > 1)
    p2p, why = open_shared_memory_p2p(groups.pp, nbytes, tags=2, timeout=timeout,
                                      peers=((rank - 1) % size, (rank + 1) % size))
    if p2p is None:
        if groups.pp.rank == 0 and groups.tp_rank == 0 and groups.dp_rank == 0:
            print(f"pipeline point-to-point through gloo: {why}", flush=True)  # a note, not an error (stdout)
        return groups.pp
    return dataclasses.replace(groups.pp, p2p=p2p)
