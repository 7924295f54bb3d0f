"""A schedule checked and timed without processes: the rules every schedule must keep, and what it costs.

- `check`: per rank, each chunk's micro-batches run forward once and backward once (or I then W once), a
  backward after its forward, W after its I, and every tensor a compute action consumes received by an earlier
  batch; between every two ranks, both post the same sequence of batches, each send facing its receive in the same
  position (what NCCL's in-order matching needs; gloo's too).
- `simulate`: runs every rank's steps with given compute times (point-to-point taking no time): a receive completes
  when its sender has posted the send, a compute action waits for what it consumes. Returns each rank's idle time
  (the end of the iteration minus its busy time), which the schedules' formulas predict, and the micro-batches it
  holds at once; a schedule that cannot finish (a cycle of waits) raises `Deadlock`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from mpzero.pipeline.schedules import COMM, Action, Pipeline, Step, peer


class ScheduleError(AssertionError):
    pass


class Deadlock(ScheduleError):
    pass


@dataclass(frozen=True)
class Times:
    """Compute time of one micro-batch through one model chunk."""
    F: float = 1.0
    B: float = 2.0
    I: float = 1.0  # noqa: E741 - the zero-bubble paper's name
    W: float = 1.0


class Replay:
    """A rank's measured compute times, action by action: its durations of each kind in the order it ran them
    (`run_schedule(timings=...)`), handed to `simulate` in place of `Times` (which asks for one per compute action,
    in the rank's order). The schedule's timing with no point-to-point cost and no assumption that all forwards
    (backwards, ...) take alike."""

    def __init__(self, timings: dict[str, list[float]]):
        self._left = {kind: list(durations) for kind, durations in timings.items()}

    def __getattr__(self, kind: str) -> float:
        if kind.startswith("_") or not self._left.get(kind):
            raise AttributeError(f"no measured {kind} left to replay")
        return self._left[kind].pop(0)


@dataclass(frozen=True)
class Simulation:
    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    in_flight: tuple[int, ...]  # per rank: the most (chunk, micro-batch) activations held at once


def _needs(pipe: Pipeline, rank: int, action: Action) -> str | None:
    """The receive a compute action consumes: its input (F, not the first virtual stage) or its output's gradient
    (B or I, not the last)."""
    if action.kind == "F" and not pipe.is_first(rank, action.chunk):
        return "RECV_F"
    if action.kind in ("B", "I") and not pipe.is_last(rank, action.chunk):
        return "RECV_B"
    return None


def check(pipe: Pipeline, schedule: list[list[Step]]) -> None:
    """Raises ScheduleError naming the first broken rule."""
    for rank, steps in enumerate(schedule):
        _check_rank(pipe, rank, steps)
    for rank in range(pipe.p):
        for other in {peer(pipe, rank, a)[0] for step in schedule[rank] for a in step if a.kind in COMM}:
            _check_pair(pipe, schedule, rank, other)


def _check_rank(pipe: Pipeline, rank: int, steps: list[Step]) -> None:
    seen, posted = Counter(), set()
    for step in steps:
        if len(step) > 1 and any(a.kind not in COMM for a in step):
            raise ScheduleError(f"rank {rank}: a compute action batched with others: {step}")
        for a in step:
            key = (a.chunk, a.micro_batch)
            if a.kind in COMM:
                if a.kind in ("SEND_F", "SEND_B") and seen[("F" if a.kind == "SEND_F" else "BI", key)] == 0:
                    raise ScheduleError(f"rank {rank}: {a} sends what is not computed yet")
                posted.add((a.kind, key))
                continue
            need = _needs(pipe, rank, a)
            if need and (need, key) not in posted:
                raise ScheduleError(f"rank {rank}: {a} runs before its {need} is posted")
            if a.kind in ("B", "I") and not seen["F", key]:
                raise ScheduleError(f"rank {rank}: {a} before its forward")
            if a.kind == "W" and not seen["I", key]:
                raise ScheduleError(f"rank {rank}: {a} before its I")
            seen[a.kind, key] += 1
            if a.kind in ("B", "I"):
                seen["BI", key] += 1
    forward_only = not any(kind in ("B", "I", "W") for kind, _ in seen)
    for chunk in range(pipe.v):
        for mb in range(pipe.m):
            key = (chunk, mb)
            split = seen["I", key] or seen["W", key]
            counts = ((seen["F", key],) if forward_only else
                      (seen["F", key], seen["I", key], seen["W", key]) if split else (seen["F", key], seen["B", key]))
            if set(counts) != {1}:
                raise ScheduleError(f"rank {rank}: chunk {chunk} micro-batch {mb} runs F/B(/I/W) {counts} times, "
                                    f"not once each")


def _check_pair(pipe: Pipeline, schedule: list[list[Step]], a: int, b: int) -> None:
    """a's batches with b face b's batches with a, in order, send for receive."""
    def towards(rank, other):
        out = []
        for step in schedule[rank]:
            part = [(x.kind, pipe.vstage(rank, x.chunk), x.micro_batch) for x in step
                    if x.kind in COMM and peer(pipe, rank, x)[0] == other]
            if part:
                out.append(part)
        return out

    mine, theirs = towards(a, b), towards(b, a)
    if len(mine) != len(theirs):
        raise ScheduleError(f"ranks {a} and {b} post {len(mine)} and {len(theirs)} batches to each other")
    flip = {"SEND_F": "RECV_F", "SEND_B": "RECV_B", "RECV_F": "SEND_F", "RECV_B": "SEND_B"}
    for i, (x, y) in enumerate(zip(mine, theirs)):
        sends = [(k, s, mb) for k, s, mb in x if k.startswith("SEND")]
        their_recvs = [(flip[k], s, mb) for k, s, mb in y if k.startswith("RECV")]
        step = {"SEND_F": 1, "SEND_B": -1}
        if [(k, s + step[k], mb) for k, s, mb in sends] != their_recvs:
            raise ScheduleError(f"batch {i} between ranks {a} and {b}: {a} sends {sends}, {b} receives {y}")


def simulate(pipe: Pipeline, schedule: list[list[Step]], times: Times | list[Times | Replay] = Times()) -> Simulation:
    """`times`: the compute times, one for every rank or each rank's own (stages of unequal cost; a `Replay`: each
    action's own)."""
    check(pipe, schedule)
    per_rank = times if isinstance(times, list) else [times] * pipe.p
    clock, busy = [0.0] * pipe.p, [0.0] * pipe.p
    index = [0] * pipe.p
    sent: dict[tuple, float] = {}  # (kind sent, receiving vstage, micro-batch) -> when posted
    progress = True
    while progress:
        progress = False
        for rank in range(pipe.p):
            while index[rank] < len(schedule[rank]):
                step = schedule[rank][index[rank]]
                action = step[0]
                if action.kind in COMM:
                    for a in step:
                        if a.kind.startswith("SEND"):
                            target = pipe.vstage(rank, a.chunk) + (1 if a.kind == "SEND_F" else -1)
                            sent[a.kind, target, a.micro_batch] = clock[rank]
                else:
                    need = _needs(pipe, rank, action)
                    ready = 0.0
                    if need:
                        key = ("SEND_F" if need == "RECV_F" else "SEND_B", pipe.vstage(rank, action.chunk),
                               action.micro_batch)
                        if key not in sent:
                            break  # its sender has not got there yet
                        ready = sent[key]
                    cost = getattr(per_rank[rank], action.kind)
                    clock[rank] = max(clock[rank], ready) + cost
                    busy[rank] += cost
                index[rank] += 1
                progress = True
    stuck = [r for r in range(pipe.p) if index[r] < len(schedule[r])]
    if stuck:
        raise Deadlock(f"ranks {stuck} wait forever (at {[schedule[r][index[r]] for r in stuck]})")
    end = max(clock)
    return Simulation(end, tuple(busy), tuple(end - b for b in busy),
                      tuple(_in_flight(steps) for steps in schedule))


def _in_flight(steps: list[Step]) -> int:
    """The most micro-batch activations held at once: from a forward until its backward (split: until its W,
    whose inputs stay alive)."""
    split = any(a.kind == "W" for step in steps for a in step)
    held = peak = 0
    for step in steps:
        for a in step:
            if a.kind == "F":
                held += 1
                peak = max(peak, held)
            elif a.kind == ("W" if split else "B"):
                held -= 1
    return peak


def bubble(kind: str, pipe: Pipeline, times: Times = Times()) -> float:
    """Each rank's idle time per iteration by the schedule's formula, in chunk times (a rank's whole layers take v
    times them): 1F1B (p - 1)(t_F + t_B); interleaved the same over v in whole-rank times, which is (p - 1)(F + B)
    in chunk times; ZB-H1 (m >= p) (p - 1) max(t_F + t_I - t_W, t_F, t_I): the paper's (p - 1)(t_F + t_I - t_W)
    where a W is no longer than F or I, as in a transformer (W has none of attention's terms), since a longer W
    cannot fill its slot without delaying the pass after it."""
    p = pipe.p
    if kind == "zb-h1":
        return (p - 1) * max(times.F + times.I - times.W, times.F, times.I)
    return (p - 1) * (times.F + times.B)
