"""The planner's pipeline terms, from the pipeline package's own functions: which part of the model each pipeline
rank holds (Megatron's split, `pipeline.stage_layers`), the ranks that hold alike (their model states are equal:
evaluated once), the bytes of the micro-batches a rank holds at once (`pipeline.in_flight`: the formula the
`activation memory` line prints), the schedule's bubble and each rank's point-to-point bytes.

Bubble, the idle fraction of the ideal compute time (PTD-P section 2.2): 1F1B (p - 1)/m; interleaved (p - 1)/(v m);
ZB-H1 (p - 1)/m x (T_F + T_I - T_W)/(T_F + T_I + T_W) (Qi et al.: its bubble (p - 1)(T_F + T_I - T_W) against 1F1B's
(p - 1)(T_F + T_I + T_W)), with their per-layer FLOPs F = sbh(24h + 4s), I = sbh(24h + 8s), W = 24sbh^2:
(24h + 12s)/(72h + 12s), a third when s << h.

Point-to-point bytes per rank per iteration, the `pipeline comm` line's theory (`pipeline.accounting.p2p_theory`):
(F + B) m A, A = b s' h e the hidden states a stage sends (s' = s/t under sequence parallelism, e the model dtype's
bytes), F and B the chunks that send forward and back; GPT-2's tied embedding: its gradient slice S all-reduced
between the first and last stage, 2S(N-1)/N = S (the loss's fp32 all-reduce over the stages, for the log, is left
out, as the line leaves it).
"""

from __future__ import annotations

import functools

from mpzero.pipeline import PipelineConfig, build, formula_bytes, held_formula, p2p_theory, stage_layers
from mpzero.tensor_parallel import is_pipeline_tied

def pipeline_stages(pipeline: PipelineConfig, num_layers: int) -> list:
    """Each pipeline rank's `ModelStage`; [None] without a pipeline (the whole model)."""
    return [None] if pipeline.size == 1 else stage_layers(pipeline, num_layers)


def stage_classes(stages: list) -> list[tuple[object, tuple[int, ...]]]:
    """(a representative stage, the pipeline ranks alike: as many layers per chunk, the same ends), in rank
    order: their parameters' shapes, hence their model states, are the same."""
    classes: dict = {}
    for rank, stage in enumerate(stages):
        key = None if stage is None else (tuple(len(c) for c in stage.chunks), stage.first, stage.last)
        classes.setdefault(key, (stage, []))[1].append(rank)
    return [(stage, tuple(ranks)) for stage, ranks in classes.values()]


@functools.lru_cache(maxsize=8)
def _steps(kind: str, pipe) -> tuple:
    return tuple(build(kind, pipe))


def in_flight_bytes(kind: str, pipe, rank: int, formula) -> tuple[int, str]:
    """(bytes, formula text) of the micro-batches rank `rank` holds at once, by the schedule's formula
    (`pipeline.in_flight.formula_bytes`); interleaved ranks whose chunks keep equal bytes hold the closed form's
    count of them (the peak of the schedule's steps, without building them)."""
    chunk_bytes = formula.chunk_bytes
    if kind == "interleaved" and len(set(chunk_bytes)) == 1:
        held, text = held_formula(kind, pipe, rank)
        return held * chunk_bytes[0], f"({text}) x M {chunk_bytes[0]:,}"
    steps = _steps(kind, pipe)[rank] if kind == "interleaved" else []
    return formula_bytes(kind, pipe, rank, list(steps), formula)


def bubble_fraction(kind: str, p: int, v: int, m: int, hidden: int, seq: int) -> float:
    """The schedule's idle time over the ideal compute time (module docstring)."""
    if p == 1:
        return 0.0
    if kind == "zb-h1":
        return (p - 1) / m * (24 * hidden + 12 * seq) / (72 * hidden + 12 * seq)
    return (p - 1) / (v * m) if kind == "interleaved" else (p - 1) / m


def tied_bytes(layouts, g: int) -> int:
    """The gradient slice of the embedding tied across the first and last stage, S (0 when there is none)."""
    return sum(g * layout.shard_numel for layout in layouts if any(is_pipeline_tied(p) for p in layout.params))


def pipeline_comm_bytes(pipe, rank: int, activation_bytes: int, tied: int) -> float:
    """Bytes per rank per iteration sent on the pipeline group and all-reduced on the embedding group (module
    docstring)."""
    return 0.0 if pipe.p == 1 else p2p_theory(pipe, rank, activation_bytes, tied, 2 if tied else 1)[0]


def hidden_state_bytes(config, tp: int, micro_batch: int, seq: int, e: int) -> int:
    """A: the hidden states one micro-batch passes between stages, [b, s/CP (/t under sequence parallelism), h]
    (a context-parallel rank's s/CP tokens)."""
    seq //= config.context_parallel_size
    return micro_batch * (seq // tp if config.sequence_parallel else seq) * config.hidden_size * e
