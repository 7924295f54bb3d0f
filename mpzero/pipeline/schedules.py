"""Pipeline schedules as data: for each pipeline rank, the ordered steps it runs in one iteration.

A step is a compute action (`F` forward, `B` backward, or zero bubble's split backward: `I` the input gradient,
`W` the weight gradient) or a batch of point-to-point actions posted together (`SEND_F`/`RECV_F` an activation,
`SEND_B`/`RECV_B` its gradient). Every action names this rank's model chunk (its virtual stage, `chunk * p + rank`)
and the micro-batch; a send's peer and the receiver's chunk follow from them (`peer`). One small executor runs any
schedule (executor.py); tests check them without processes (simulate.py: every forward before its backward, each
send matched by a receive in the same order, no deadlock, idle time = the schedule's formula).

- `one_f_one_b`: PipeDream-Flush (Megatron's 1F1B): rank r runs min(p - r - 1, m) warm-up forwards, then one
  forward and one backward in turn, then the remaining backwards; it holds at most p - r micro-batches'
  activations. Idle time (p - 1)(t_F + t_B) per rank.
- `interleaved`: Megatron's interleaved 1F1B, v model chunks per rank placed round-robin (chunk c of rank r is
  virtual stage c p + r); forwards run p micro-batches per chunk in turn, the warm-up is 2 (p - r - 1) + (v - 1) p
  forward chunks; m must be a multiple of p. Idle (p - 1)(t_F + t_B) / v (t: a whole rank's layers), at v times
  the point-to-point traffic; activations 1 + (p - 1)/(p v) times 1F1B's.
- `zb_h1`: Qi et al.'s ZB-H1: 1F1B with each backward split into I (sent on at once) and W, rank r running the W
  of micro-batch k after the I of micro-batch k + r (the first r held back to fill the cool-down's bubble). Idle
  (p - 1)(t_F + t_I - t_W) where W is no longer than F and I (simulate.bubble), a third of 1F1B's when the three
  are equal, holding at most p micro-batches' inputs on every rank (1F1B's stage 0). Needs m >= p.

Communication follows Megatron's pairing (a send posted with the receive the same two ranks exchange at that
moment), so each pair of ranks posts the same sequence of batches and NCCL's in-order matching holds.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

COMPUTE = ("F", "B", "I", "W")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
SCHEDULES = ("1f1b", "interleaved", "zb-h1")


@dataclass(frozen=True)
class Action:
    kind: str  # one of COMPUTE or COMM
    chunk: int  # this rank's model chunk: virtual stage chunk * p + rank
    micro_batch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.micro_batch}"


Step = tuple[Action, ...]  # one compute action, or point-to-point actions posted together


@dataclass(frozen=True)
class Pipeline:
    """The shape of a pipeline: p ranks, v chunks each, m micro-batches per iteration."""
    p: int
    v: int
    m: int

    def vstage(self, rank: int, chunk: int) -> int:
        return chunk * self.p + rank

    def is_first(self, rank: int, chunk: int) -> bool:
        return rank == 0 and chunk == 0

    def is_last(self, rank: int, chunk: int) -> bool:
        return rank == self.p - 1 and chunk == self.v - 1


def peer(pipe: Pipeline, rank: int, action: Action) -> tuple[int, int]:
    """(the other rank, its chunk) of a point-to-point action: activations go to the next virtual stage and come
    from the previous one, gradients the other way."""
    step = 1 if action.kind in ("SEND_F", "RECV_B") else -1
    s = pipe.vstage(rank, action.chunk) + step
    return s % pipe.p, s // pipe.p


def build(kind: str, pipe: Pipeline) -> list[list[Step]]:
    """Every rank's steps for schedule `kind` (one of SCHEDULES, or "forward" for evaluation)."""
    make = {"1f1b": one_f_one_b, "interleaved": interleaved, "zb-h1": zb_h1, "forward": forward_only}[kind]
    return [make(pipe, rank) for rank in range(pipe.p)]


class _Steps(list):
    """A rank's step list; `comm` appends a batch (nothing when empty)."""

    def compute(self, kind: str, chunk: int, micro_batch: int) -> None:
        self.append((Action(kind, chunk, micro_batch),))

    def comm(self, *actions: Action | None) -> None:
        batch = tuple(a for a in actions if a is not None)
        if batch:
            self.append(_canonical(batch))


def _canonical(batch: Step) -> Step:
    """Sends before receives, activations before gradients: both ranks of a pair list what passes between them in
    the same order (what one sends as an activation the other receives as one)."""
    order = {"SEND_F": 0, "SEND_B": 1, "RECV_F": 2, "RECV_B": 3}
    return tuple(sorted(batch, key=lambda a: order[a.kind]))


def one_f_one_b(pipe: Pipeline, rank: int, split_backward: bool = False) -> list[Step]:
    """1F1B for one rank (v = 1); `split_backward`: ZB-H1's I and W in place of B (see `zb_h1`)."""
    p, m = pipe.p, pipe.m
    first, last = rank == 0, rank == p - 1
    warmup = min(p - rank - 1, m)
    steps, held = _Steps(), []

    def recv_f(k):
        return None if first else Action("RECV_F", 0, k)

    def send_f(k):
        return None if last else Action("SEND_F", 0, k)

    def recv_b(k):
        return None if last else Action("RECV_B", 0, k)

    def send_b(k):
        return None if first else Action("SEND_B", 0, k)

    def backward(k, after: tuple):
        if not split_backward:
            steps.compute("B", 0, k)
            steps.comm(*after)
            return
        steps.compute("I", 0, k)
        steps.comm(*after)
        held.append(k)
        while len(held) > rank:  # rank r holds back r weight gradients
            steps.compute("W", 0, held.pop(0))

    for k in range(warmup):
        steps.comm(recv_f(k))
        steps.compute("F", 0, k)
        steps.comm(send_f(k))
    steady = m - warmup
    if steady:
        steps.comm(recv_f(warmup))
    for i in range(steady):
        f, b = warmup + i, i
        steps.compute("F", 0, f)
        steps.comm(send_f(f), recv_b(b))
        backward(b, (send_b(b),) if i == steady - 1 else (send_b(b), recv_f(f + 1)))
    for b in range(steady, m):
        steps.comm(recv_b(b))
        backward(b, (send_b(b),))
    for k in held:
        steps.compute("W", 0, k)
    return list(steps)


def zb_h1(pipe: Pipeline, rank: int) -> list[Step]:
    return one_f_one_b(pipe, rank, split_backward=True)


def forward_only(pipe: Pipeline, rank: int) -> list[Step]:
    """Evaluation: each micro-batch through every virtual stage in turn, received, run, sent on."""
    steps = _Steps()
    for mb in range(pipe.m):
        for chunk in range(pipe.v):
            steps.comm(None if pipe.is_first(rank, chunk) else Action("RECV_F", chunk, mb))
            steps.compute("F", chunk, mb)
            steps.comm(None if pipe.is_last(rank, chunk) else Action("SEND_F", chunk, mb))
    return list(steps)


def interleaved(pipe: Pipeline, rank: int) -> list[Step]:
    """Megatron's interleaved 1F1B (forward_backward_pipelining_with_interleaving) for one rank."""
    return _Interleaved(pipe, rank).steps()


class _Interleaved:
    """One rank's interleaved steps: the k-th forward unit runs chunk (k // p) % v on micro-batch
    (k // (p v)) p + k % p, backwards the chunks in reverse. Received tensors queue per chunk in arrival order, as
    Megatron's lists do: the j-th tensor a chunk receives belongs to the j-th forward (or backward) of that chunk."""

    def __init__(self, pipe: Pipeline, rank: int):
        self.pipe, self.rank = pipe, rank
        p, v, m = pipe.p, pipe.v, pipe.m
        self.total, self.first_rank, self.last_rank = m * v, rank == 0, rank == p - 1
        self.forwards, self.backwards = defaultdict(list), defaultdict(list)  # chunk -> micro-batches in order
        for k in range(self.total):
            self.forwards[self.f_chunk(k)].append(self.micro(k))
            self.backwards[self.b_chunk(k)].append(self.micro(k))
        self.received = defaultdict(int)  # (kind, chunk) -> tensors received so far
        self.all_warmup = m == p
        self.warmup = self.total if self.all_warmup else min((p - rank - 1) * 2 + (v - 1) * p, self.total)
        self.out = _Steps()

    def f_chunk(self, k: int) -> int:
        return (k // self.pipe.p) % self.pipe.v

    def b_chunk(self, k: int) -> int:
        return self.pipe.v - 1 - self.f_chunk(k)

    def micro(self, k: int) -> int:
        p = self.pipe.p
        return (k // (p * self.pipe.v)) * p + k % p

    def recv(self, kind: str, chunk: int) -> Action:
        order = self.forwards if kind == "RECV_F" else self.backwards
        n = self.received[kind, chunk]
        self.received[kind, chunk] += 1
        return Action(kind, chunk, order[chunk][n])

    def send_f(self, k: int) -> Action | None:
        chunk = self.f_chunk(k)
        return None if self.pipe.is_last(self.rank, chunk) else Action("SEND_F", chunk, self.micro(k))

    def send_b(self, k: int) -> Action | None:
        chunk = self.b_chunk(k)
        return None if self.pipe.is_first(self.rank, chunk) else Action("SEND_B", chunk, self.micro(k))

    def steps(self) -> list[Step]:
        if not self.first_rank:
            self.out.comm(self.recv("RECV_F", 0))
        self._warmup()
        self._steady()
        self._cooldown()
        return list(self.out)

    def _warmup(self) -> None:
        for k in range(self.warmup):
            self.out.compute("F", self.f_chunk(k), self.micro(k))
            recv_prev = k + 1 < self.total and not (self.first_rank and self.f_chunk(k + 1) == 0)
            receive = self.recv("RECV_F", self.f_chunk(k + 1)) if recv_prev else None
            if k == self.warmup - 1 and not self.all_warmup:  # the first backward's gradient comes with it
                self.out.comm(self.send_f(k), receive, None if self.last_rank else self.recv("RECV_B", self.pipe.v - 1))
            else:
                self.out.comm(self.send_f(k), receive)

    def _steady(self) -> None:
        p, v, steady = self.pipe.p, self.pipe.v, self.total - self.warmup
        for k in range(steady):
            fk, bk = k + self.warmup, k
            self.out.compute("F", self.f_chunk(fk), self.micro(fk))
            self.out.compute("B", self.b_chunk(bk), self.micro(bk))
            if self.first_rank:  # the first rank runs p - 1 forwards ahead of the last one
                ahead = self.f_chunk(fk - (p - 1))
                recv_prev, next_f = ahead != v - 1, ahead + 1
            else:
                recv_prev, next_f = True, self.f_chunk(fk + 1)
            if self.last_rank:
                behind = self.b_chunk(bk - (p - 1))
                recv_next, next_b = behind != 0, behind - 1
            else:
                recv_next, next_b = True, self.b_chunk(bk + 1)
            recv_prev = recv_prev and k < steady - 1
            self.out.comm(self.send_f(fk), self.send_b(bk), self.recv("RECV_F", next_f) if recv_prev else None,
                          self.recv("RECV_B", next_b) if recv_next else None)

    def _cooldown(self) -> None:
        if self.all_warmup and not self.last_rank:
            self.out.comm(self.recv("RECV_B", self.pipe.v - 1))
        for k in range(self.total - self.warmup, self.total):
            self.out.compute("B", self.b_chunk(k), self.micro(k))
            recv_next = k + 1 < self.total and not (self.last_rank and self.b_chunk(k + 1) == self.pipe.v - 1)
            self.out.comm(self.send_b(k), self.recv("RECV_B", self.b_chunk(k + 1)) if recv_next else None)
