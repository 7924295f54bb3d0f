"""The pipeline schedules as data (mpzero/pipeline/schedules.py), checked without processes: for p 1-8, v 1-4 and
several m, every rank runs each chunk's micro-batches forward once and backward once (or I then W), a backward after
its forward, each received tensor posted before it is used; every two ranks post the same sequence of batches, each
send facing its receive; the simulation finishes (no deadlock); each rank's idle time is the schedule's formula and
the micro-batches it holds are 1F1B's p - r, interleaved 1F1B's p + (p - 1)/v (Megatron's penalty), ZB-H1's p. And
the layer split (config.py) against Megatron's documented example and rules."""

import random

import pytest

from mpzero.errors import ConfigError
from mpzero.pipeline import (Action, Deadlock, Pipeline, PipelineConfig, Replay, ScheduleError, Times, bubble, build,
                             check, simulate, stage_layers)

SHAPES = [(p, v, m) for p in range(1, 9) for v in (1, 2, 3, 4) for m in (1, 2, 3, 4, 6, 8, 12, 16)]


def _shapes(kind):
    for p, v, m in SHAPES:
        if kind == "interleaved" and (p == 1 or v == 1 or m % p):
            continue
        if kind != "interleaved" and v > 1:
            continue
        if kind == "zb-h1" and (p == 1 or m < p):
            continue
        yield Pipeline(p, v, m)


@pytest.mark.parametrize("kind", ["1f1b", "interleaved", "zb-h1", "forward"])
def test_every_schedule_keeps_the_rules_and_finishes(kind):
    count = 0
    for pipe in _shapes(kind if kind != "forward" else "1f1b"):
        simulate(pipe, build(kind, pipe))  # check() first, then the run
        count += 1
    assert count >= 30


@pytest.mark.parametrize("kind", ["1f1b", "interleaved", "zb-h1"])
def test_idle_time_equals_the_formula_for_any_compute_times(kind):
    """1F1B (p - 1)(F + B); interleaved the same in chunk times, i.e. 1/v of 1F1B's in whole-rank times; ZB-H1
    (p - 1) max(F + I - W, F, I): the paper's (p - 1)(F + I - W) where W <= F, I, as in a transformer."""
    rng = random.Random(0)
    for pipe in _shapes(kind):
        times = Times(F=rng.uniform(0.5, 2), B=rng.uniform(1, 4), I=rng.uniform(0.5, 2), W=rng.uniform(0.2, 2))
        idle = simulate(pipe, build(kind, pipe), times).idle
        assert all(abs(i - bubble(kind, pipe, times)) < 1e-9 for i in idle), (pipe, times, idle)


def test_a_replay_of_each_actions_time_is_the_simulation_it_times():
    """Measured times replayed action by action (bench_pipeline.py's comparison): alike, the simulation with their
    mean. A slow first forward delays the step by as much; the same forward later, in the shadow of the other
    stage's backward, costs nothing (what a mean spreads over every forward)."""
    pipe = Pipeline(2, 1, 4)
    alike = [Replay({"F": [1.0] * 4, "B": [2.0] * 4}) for _ in range(2)]
    assert simulate(pipe, build("1f1b", pipe), alike) == simulate(pipe, build("1f1b", pipe), Times(F=1, B=2))
    for forwards, makespan in (([1.5, 1.0, 1.0, 1.0], 15.5), ([1.0, 1.5, 1.0, 1.0], 15.0)):
        slow = [Replay({"F": forwards, "B": [2.0] * 4}), Replay({"F": [1.0] * 4, "B": [2.0] * 4})]
        assert simulate(pipe, build("1f1b", pipe), slow).makespan == makespan
    with pytest.raises(AttributeError, match="no measured F left"):
        simulate(pipe, build("1f1b", pipe), [Replay({"F": [1.0], "B": [2.0] * 4})] * 2)


def test_zero_bubble_idles_a_third_of_1f1b_when_the_passes_are_equal():
    pipe = Pipeline(4, 1, 8)
    equal = Times(F=1, B=2, I=1, W=1)
    assert bubble("zb-h1", pipe, equal) * 3 == bubble("1f1b", pipe, equal) == 9


@pytest.mark.parametrize("p,v,m", [(4, 1, 8), (4, 2, 8), (8, 4, 16), (2, 3, 4), (5, 1, 3)])
def test_micro_batches_held_follow_megatrons_formulas(p, v, m):
    if v == 1:
        assert simulate(Pipeline(p, 1, m), build("1f1b", Pipeline(p, 1, m))).in_flight == tuple(
            min(p - r, m) for r in range(p))
        if m >= p:
            assert set(simulate(Pipeline(p, 1, m), build("zb-h1", Pipeline(p, 1, m))).in_flight) == {p}
        return
    held = simulate(Pipeline(p, v, m), build("interleaved", Pipeline(p, v, m))).in_flight
    assert held[0] / v == p * (1 + (p - 1) / (p * v))  # rank 0's chunks, in whole-stage units
    assert list(held) == sorted(held, reverse=True)


def test_the_checker_sees_a_broken_schedule():
    pipe = Pipeline(2, 1, 2)
    good = build("1f1b", pipe)
    swapped = [list(good[0]), list(good[1])]
    f = next(i for i, step in enumerate(swapped[1]) if step[0].kind == "F")
    swapped[1].insert(0, swapped[1].pop(f))  # rank 1 runs a forward before receiving its input
    with pytest.raises(ScheduleError, match="before its RECV_F is posted"):
        check(pipe, swapped)
    split = [list(good[0]), [part for step in good[1] for part in ([(a,) for a in step] if len(step) > 1 else [step])]]
    with pytest.raises(ScheduleError, match="post 3 and 4 batches to each other"):  # NCCL would hang on it
        check(pipe, split)
    waits = [[(Action("RECV_B", 0, 0),), (Action("F", 0, 0),), (Action("SEND_F", 0, 0),), (Action("B", 0, 0),)],
             [(Action("RECV_F", 0, 0),), (Action("F", 0, 0),), (Action("B", 0, 0),), (Action("SEND_B", 0, 0),)]]
    with pytest.raises(ScheduleError):
        check(Pipeline(2, 1, 1), waits)
    late = [[(Action("F", 0, 0),), (Action("SEND_F", 0, 0),), (Action("RECV_B", 0, 0),), (Action("B", 0, 0),)],
            [(Action("RECV_F", 0, 0),), (Action("SEND_B", 0, 0),), (Action("F", 0, 0),), (Action("B", 0, 0),)]]
    with pytest.raises(ScheduleError, match="sends what is not computed"):
        check(Pipeline(2, 1, 1), late)


def test_a_cycle_of_waits_never_runs():
    """Rank 0 holds its activation back until its gradient arrives, which needs that activation: refused."""
    steps = [[(Action("F", 0, 0),), (Action("RECV_B", 0, 0),), (Action("B", 0, 0),), (Action("SEND_F", 0, 0),)],
             [(Action("RECV_F", 0, 0),), (Action("F", 0, 0),), (Action("B", 0, 0),), (Action("SEND_B", 0, 0),)]]
    with pytest.raises((Deadlock, ScheduleError)):
        simulate(Pipeline(2, 1, 1), steps)


def test_layer_split_matches_megatrons_documented_example():
    """parallel_state's docstring: 16 layers, PP 4, virtual 2: rank 0 holds layers 1-2 and 9-10 (1-based)."""
    stages = stage_layers(PipelineConfig(4, 2), 16)
    assert [s.chunks for s in stages] == [((0, 1), (8, 9)), ((2, 3), (10, 11)), ((4, 5), (12, 13)),
                                         ((6, 7), (14, 15))]
    assert [(s.first, s.last) for s in stages] == [(True, False), (False, False), (False, False), (False, True)]


def test_uneven_and_accounted_splits():
    uneven = stage_layers(PipelineConfig(4, first_stage_layers=1, last_stage_layers=1), 8)
    assert [s.chunks for s in uneven] == [((0,),), ((1, 2, 3),), ((4, 5, 6),), ((7,),)]
    accounted = stage_layers(PipelineConfig(2, account_for_embedding=True, account_for_loss=True), 6)
    assert [s.chunks for s in accounted] == [((0, 1, 2),), ((3, 4, 5),)]
    with pytest.raises(ConfigError, match=r"--num-layers 7 \+ 1 \(embedding\) is not divisible"):
        stage_layers(PipelineConfig(3, account_for_embedding=True), 7)
    with pytest.raises(ConfigError, match="does not divide evenly over the 2 other stages"):
        stage_layers(PipelineConfig(4, first_stage_layers=2, last_stage_layers=1), 8)
