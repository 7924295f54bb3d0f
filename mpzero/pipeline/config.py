"""What a pipeline-parallel run is: its schedule and which layers each rank holds, by Megatron's flags and rules.

`PipelineConfig` is the run's section (the size itself is `ParallelConfig.pipeline_model_parallel_size`);
`stage_layers` assigns the transformer layers to virtual stages the way Megatron-core does
(`get_num_layers_to_build`, `get_transformer_layer_offset`): evenly, or with `--decoder-first-pipeline-num-layers`
/ `--decoder-last-pipeline-num-layers` on the first and last rank and the rest evenly over the others; with
`--account-for-embedding-in-pipeline-split` / `--account-for-loss-in-pipeline-split` the embedding and the loss
each count as one layer of the first and last virtual stage. With v virtual stages per rank, rank r's chunk c is
virtual stage c p + r (round robin: 16 layers, PP 4, v 2 give rank 0 layers 0-1 and 8-9), each rank's layers split
evenly over its chunks. Every rule broken is one ConfigError line naming the flags.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpzero.errors import ConfigError
from mpzero.models import ModelStage
from mpzero.pipeline.schedules import SCHEDULES, Pipeline


@dataclass(frozen=True)
class PipelineConfig:
    size: int = 1  # --pipeline-model-parallel-size (also ParallelConfig's: the grid's)
    virtual_stages: int = 1  # --num-virtual-stages-per-pipeline-rank (or from --num-layers-per-virtual-pipeline-stage)
    first_stage_layers: int | None = None  # --decoder-first-pipeline-num-layers
    last_stage_layers: int | None = None  # --decoder-last-pipeline-num-layers
    account_for_embedding: bool = False  # --account-for-embedding-in-pipeline-split
    account_for_loss: bool = False  # --account-for-loss-in-pipeline-split
    zero_bubble: bool = False  # --enable-zero-bubble: ZB-H1

    @property
    def schedule(self) -> str:
        return "zb-h1" if self.zero_bubble else "interleaved" if self.virtual_stages > 1 else "1f1b"

    def pipe(self, micro_batches: int) -> Pipeline:
        return Pipeline(self.size, self.virtual_stages, micro_batches)

    def validate(self, num_layers: int, micro_batches: int) -> None:
        """Every rule of the section against the model's layers and the micro-batches per iteration."""
        stage_layers(self, num_layers)
        p, m = self.size, micro_batches
        if self.schedule == "interleaved" and m % p:
            raise ConfigError(f"the interleaved schedule runs micro-batches in groups of --pipeline-model-parallel-size"
                              f" {p}, and this run has {m} per iteration (--global-batch-size / (--micro-batch-size x "
                              f"data-parallel size)): use a multiple of {p} (Megatron's rule)")
        if self.zero_bubble and m < p:
            raise ConfigError(f"--enable-zero-bubble fills the pipeline's {p - 1} idle slots with held-back weight "
                              f"gradients and needs at least --pipeline-model-parallel-size {p} micro-batches per "
                              f"iteration; this run has {m}: raise --global-batch-size")
        assert self.schedule in SCHEDULES


def virtual_stages(size: int, num_layers: int, layers_per_virtual_stage: int | None,
                   stages_per_rank: int | None) -> int:
    """Megatron's two spellings of the interleaved schedule's model chunks per rank (at most one given)."""
    if layers_per_virtual_stage is not None and stages_per_rank is not None:
        raise ConfigError("--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank both "
                          "set the virtual stages: give one of them")
    given = layers_per_virtual_stage or stages_per_rank
    if given is not None and size == 1:
        raise ConfigError("virtual pipeline stages (--num-layers-per-virtual-pipeline-stage, "
                          "--num-virtual-stages-per-pipeline-rank) interleave a pipeline: they need "
                          "--pipeline-model-parallel-size > 1")
    if layers_per_virtual_stage is None:
        return stages_per_rank or 1
    if num_layers % (size * layers_per_virtual_stage):
        raise ConfigError(f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {size} x "
                          f"--num-layers-per-virtual-pipeline-stage {layers_per_virtual_stage}")
    return num_layers // (size * layers_per_virtual_stage)


def check_composition(config: PipelineConfig, zero_stage: int, cuda_graph_impl: str) -> None:
    """What a pipeline does not run with, one ConfigError line each, saying why."""
    p = config.size
    if config.zero_bubble and p == 1:
        raise ConfigError("--enable-zero-bubble fills a pipeline's idle slots: it needs "
                          "--pipeline-model-parallel-size > 1")
    if p == 1:
        return
    if zero_stage == 3:
        raise ConfigError("--zero-stage 3 gathers each unit in the order one micro-batch uses them "
                          "(zero/schedule3.py), and a pipeline interleaves micro-batches: use --zero-stage 0, 1 or "
                          "2 with --pipeline-model-parallel-size > 1 (Megatron and DeepSpeed stop at 1)")
    if zero_stage == 2 and config.schedule != "1f1b":
        raise ConfigError(f"--zero-stage 2 reduce-scatters every gradient bucket at the end of each micro-batch's "
                          f"backward, and the {config.schedule} schedule's backward of one micro-batch comes in "
                          f"parts ({'model chunks' if config.virtual_stages > 1 else 'I and W'}): use --zero-stage "
                          f"0 or 1 (full gradient buffers through the step, reduced once)")
    if config.zero_bubble and config.virtual_stages > 1:
        raise ConfigError("--enable-zero-bubble builds ZB-H1, one model chunk per rank: drop the virtual stages")
    if cuda_graph_impl != "none":
        raise ConfigError(f"--cuda-graph-impl {cuda_graph_impl} captures the whole model as one graph, which a "
                          f"pipeline splits into stages fed by other ranks: drop it with "
                          f"--pipeline-model-parallel-size > 1")


def stage_layers(config: PipelineConfig, num_layers: int) -> list[ModelStage]:
    """Each pipeline rank's `ModelStage`: its layers by chunk (global indices)."""
    p, v = config.size, config.virtual_stages
    per_rank = _layers_per_rank(config, num_layers)
    counts = []  # layers of each virtual stage, in order
    for chunk in range(v):
        for rank in range(p):
            if per_rank[rank] % v:
                raise ConfigError(f"pipeline rank {rank} holds {per_rank[rank]} layers, which do not split into "
                                  f"{v} virtual stages (--num-virtual-stages-per-pipeline-rank): change the layer "
                                  f"counts or the virtual stages")
            counts.append(per_rank[rank] // v)
    if config.account_for_embedding:
        counts[0] -= 1
    if config.account_for_loss:
        counts[-1] -= 1
    empty = [s for s, n in enumerate(counts) if n < 1 and not (s in (0, len(counts) - 1) and n == 0)]
    if empty or min(counts) < 0:
        raise ConfigError(f"--num-layers {num_layers} leaves virtual stage {empty[0] if empty else 0} of the "
                          f"{p * v} without a transformer layer: use more layers or fewer stages")
    chunks = [[None] * v for _ in range(p)]
    start = 0
    for s, n in enumerate(counts):
        chunks[s % p][s // p] = tuple(range(start, start + n))
        start += n
    return [ModelStage(tuple(chunks[r]), first=r == 0, last=r == p - 1) for r in range(p)]


def _layers_per_rank(config: PipelineConfig, num_layers: int) -> list[int]:
    """Megatron's split: uneven first/last ranks, the rest even; or even over the layers plus the embedding and
    loss when they are accounted for."""
    p, first, last = config.size, config.first_stage_layers, config.last_stage_layers
    if first is None and last is None:
        units = num_layers + config.account_for_embedding + config.account_for_loss
        if units % p:
            accounted = "".join(f" + 1 ({name})" for name, on in (("embedding", config.account_for_embedding),
                                                                  ("loss", config.account_for_loss)) if on)
            raise ConfigError(f"--num-layers {num_layers}{accounted} is not divisible by "
                              f"--pipeline-model-parallel-size {p}: each stage holds an equal share (or set "
                              f"--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers)")
        return [units // p] * p
    if config.account_for_embedding or config.account_for_loss:
        raise ConfigError("--account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split split "
                          "the layers evenly: drop them or --decoder-first/last-pipeline-num-layers")
    if p == 1 or (p == 2 and first is not None and last is not None and first + last != num_layers):
        raise ConfigError(f"--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1 and "
                          f"must add up to --num-layers {num_layers} when there are no other stages")
    left, ranks = num_layers - (first or 0) - (last or 0), p - (first is not None) - (last is not None)
    if left < 0 or (ranks and left % ranks) or (not ranks and left):
        raise ConfigError(f"--num-layers {num_layers} minus the first stage's {first or 0} and the last stage's "
                          f"{last or 0} layers leaves {left}, which does not divide evenly over the {ranks} other "
                          f"stages (Megatron's rule for uneven pipelines)")
    per = [left // ranks if ranks else 0] * p
    if first is not None:
        per[0] = first
    if last is not None:
        per[-1] = last
    return per
