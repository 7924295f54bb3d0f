"""The rank grid, built the Megatron way, returned as a value.

Megatron's default order `tp-cp-ep-dp-pp`: the first axis varies fastest. Tensor-parallel ranks are adjacent
(TP=2: [0,1],[2,3],...) so they share a node and its fast links; context-parallel ranks next, then data-parallel
ranks, and pipeline stages outermost (with TP 2, PP 4 on 16 ranks: TP [0,1]..., DP [0,2],[1,3],[4,6]...,
PP [0,4,8,12]...; Megatron's `initialize_model_parallel` example). Expert parallelism folds into the
context- and data-parallel ranks (Megatron's "parallel folding", its expert grid `etp-ep-edp-pp` over the same
ranks): an expert-TP group takes adjacent ranks (the TP group itself at ETP = TP, Megatron's default), an EP group
the next ones, the expert-DP group the rest. Layers and optimizers take the
`ParallelGroups` they need explicitly: there is no module-level state. An axis of size 1 is a group of one rank
whose collectives are identities, so a run without PP, CP or EP takes the same code path as before they existed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mpzero.comm import CommGroup, SharedMemorySlot
from mpzero.errors import ConfigError
from mpzero.launcher_env import launcher_env


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's groups: tp, cp, dp, pp (Megatron's dense grid), dp_cp (ZeRO's and the loss's reduction group:
    the data- and context-parallel ranks together), expert_tp, ep and expert_dp (the expert grid: an expert's
    weights split over expert_tp, the experts over ep, their replicas over expert_dp, where ZeRO partitions them),
    embedding (the first and last pipeline stage of this rank's pipeline: the tied word embedding's copies),
    world."""
    tp: CommGroup
    dp: CommGroup
    world: CommGroup
    device: torch.device
    pp: CommGroup
    cp: CommGroup
    dp_cp: CommGroup
    ep: CommGroup
    expert_dp: CommGroup
    embedding: CommGroup
    expert_tp: CommGroup

    @property
    def tp_size(self) -> int:
        return self.tp.size

    @property
    def tp_rank(self) -> int:
        return self.tp.rank

    @property
    def dp_size(self) -> int:
        return self.dp.size

    @property
    def dp_rank(self) -> int:
        return self.dp.rank

    @property
    def pp_size(self) -> int:
        return self.pp.size

    @property
    def pp_rank(self) -> int:
        return self.pp.rank

    @property
    def sizes(self) -> GridSizes:
        return GridSizes(tp=self.tp.size, pp=self.pp.size, cp=self.cp.size, ep=self.ep.size, etp=self.expert_tp.size)

    @property
    def is_first_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1

    @property
    def is_logging_rank(self) -> bool:
        """The last pipeline stage (which holds the loss), its first TP, CP and DP rank (Megatron logs from the
        last rank); world rank 0 without pipeline parallelism."""
        return self.is_last_stage and self.tp.rank == 0 and self.dp_cp.rank == 0


@dataclass(frozen=True)
class GridSizes:
    """The sizes of the axes a world is split into; DP is what is left: world / (TP x CP x PP). The expert grid
    folds over the TP x CP x DP ranks of a stage: expert-TP `etp` (None: TP, Megatron's default) x EP x expert-DP."""
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def expert_dp(self, world_size: int) -> int:
        return self.tp * self.cp * self.dp(world_size) // (self.expert_tp * self.ep)

    def dp(self, world_size: int) -> int:
        return world_size // (self.tp * self.cp * self.pp)

    def check(self, world_size: int) -> None:
        """One ConfigError line naming the flag that does not divide the world."""
        for name, flag in (("tp", "--tensor-model-parallel-size"), ("pp", "--pipeline-model-parallel-size"),
                           ("cp", "--context-parallel-size"), ("ep", "--expert-model-parallel-size"),
                           ("expert_tp", "--expert-tensor-parallel-size")):
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag} {getattr(self, name)} must be positive")
        tp, cp, pp, ep = self.tp, self.cp, self.pp, self.ep
        if world_size % tp:
            raise ConfigError(f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp}: "
                              f"launch a multiple of {tp} processes or change the TP size")
        if world_size % (tp * cp * pp):
            raise ConfigError(f"world size {world_size} is not divisible by TP {tp} x CP {cp} x PP {pp} = "
                              f"{tp * cp * pp}: launch a multiple of {tp * cp * pp} processes or change the sizes")
        etp, folded = self.expert_tp, tp * cp * self.dp(world_size)
        if self.etp is None and (cp * self.dp(world_size)) % ep:
            raise ConfigError(f"--expert-model-parallel-size {ep} does not divide the {cp * self.dp(world_size)} "
                              f"context- and data-parallel ranks (CP {cp} x DP {self.dp(world_size)}) it is "
                              f"carved from")
        if self.etp is not None and (tp * cp * self.dp(world_size)) % (etp * ep):
            raise ConfigError(f"--expert-tensor-parallel-size {etp} x --expert-model-parallel-size {ep} does not "
                              f"divide the {folded} tensor-, context- and data-parallel ranks (TP {tp} x CP {cp} x "
                              f"DP {self.dp(world_size)}) the expert grid is folded into")


def rank_grid(world_size: int, sizes: GridSizes = GridSizes()) -> dict[str, list[list[int]]]:
    """Every group of every axis as lists of global ranks (each ascending; a group's rank is its index there), by
    name: tp, cp, dp, pp, dp_cp, expert_tp, ep, expert_dp, embedding. Pure, so it is tested without processes."""
    sizes.check(world_size)
    dp = sizes.dp(world_size)
    dense = (("tp", sizes.tp), ("cp", sizes.cp), ("dp", dp), ("pp", sizes.pp))
    expert = (("etp", sizes.expert_tp), ("ep", sizes.ep), ("edp", sizes.expert_dp(world_size)), ("pp", sizes.pp))
    grid = {name: _groups(dense, axes) for name, axes in
            (("tp", {"tp"}), ("cp", {"cp"}), ("dp", {"dp"}), ("pp", {"pp"}), ("dp_cp", {"dp", "cp"}))}
    grid["ep"], grid["expert_dp"] = _groups(expert, {"ep"}), _groups(expert, {"edp"})
    grid["expert_tp"] = _groups(expert, {"etp"})
    grid["embedding"] = [sorted({ranks[0], ranks[-1]}) for ranks in grid["pp"]]
    return grid


def _groups(axes: tuple[tuple[str, int], ...], varying: set[str]) -> list[list[int]]:
    """The groups of ranks that differ only along the `varying` axes, for a grid whose axes are listed fastest
    first; groups in the order of the other axes' coordinates (fastest first), as Megatron lists them."""
    strides, stride = {}, 1
    for name, size in axes:
        strides[name], stride = stride, stride * size

    def offsets(names: list[tuple[str, int]]) -> list[int]:
        ranges = [range(0, size * strides[name], strides[name]) for name, size in reversed(names)]
        return [sum(combo) for combo in itertools.product(*ranges)]  # the last listed (slowest) axis outermost

    inside = [(n, s) for n, s in axes if n in varying]
    outside = [(n, s) for n, s in axes if n not in varying]
    return [sorted(base + offset for offset in offsets(inside)) for base in offsets(outside)]


BACKENDS = ("nccl", "gloo")


def default_backend() -> str:
    """NCCL where CUDA is available, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_parallel(tp_size: int = 1, timeout_minutes: float = 10.0, backend: str | None = None, *, pp_size: int = 1,
                  cp_size: int = 1, ep_size: int = 1, etp_size: int | None = None) -> ParallelGroups:
    """Join (or create) the default process group and carve it into the grid's groups (`rank_grid`).

    Under torchrun the environment names rank and world; as plain `python` a world of one is made,
    so one code path serves 1 and N processes. Collectives fail after `timeout_minutes` instead of
    hanging when a peer is gone. `backend`: "nccl" (ranks compute on their LOCAL_RANK's GPU) or "gloo"
    (ranks compute on the CPU, also on a GPU host); default `default_backend()`. When the default group
    already exists (the caller made it), a `backend` given must be the one it has.
    """
    timeout = timedelta(minutes=timeout_minutes)
    if backend is not None and backend not in BACKENDS:
        raise ConfigError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("backend 'nccl' needs CUDA, and torch sees no GPU here: use backend='gloo'")
    if dist.is_initialized():
        if backend is not None and backend not in dist.get_backend():
            raise ConfigError(f"the process group already exists with backend {dist.get_backend()!r}, not the "
                              f"{backend!r} asked for: drop the backend argument or create the group with it")
    else:
        backend = backend or default_backend()
        # NCCL binds each rank to its GPU before the first communicator exists (and barriers use it)
        device_id = _device_for_backend(backend) if backend == "nccl" else None
        if launcher_env().launched:  # the launcher's variables checked (one line each), never a traceback
            dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout,
                                    device_id=device_id)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    grid = rank_grid(world_size, GridSizes(tp=tp_size, pp=pp_size, cp=cp_size, ep=ep_size, etp=etp_size))
    device = _device_for_backend(dist.get_backend())
    made: dict[tuple[int, ...], dist.ProcessGroup] = {}
    slots: dict[tuple[int, ...], SharedMemorySlot] = {}

    def make(groups: list[list[int]]) -> CommGroup:
        """This rank's group, with its own byte counter; a process group only for groups of two ranks or more,
        made once per set of ranks (every rank enters every new_group call, in the same order). A rank in no
        group (a middle pipeline stage has no embedding group) is a group of itself."""
        mine = CommGroup(None, (rank,), 0)
        for ranks in groups:
            key = tuple(ranks)
            if len(key) > 1 and key not in made:
                made[key] = dist.new_group(ranks, timeout=timeout)
                slots[key] = SharedMemorySlot(timeout.total_seconds())
            if rank in ranks:
                mine = CommGroup(made.get(key), key, ranks.index(rank), shared=slots.get(key))
        return mine

    mine = {name: make(groups) for name, groups in grid.items()}
    if mine["dp_cp"].ranks == mine["dp"].ranks:  # CP 1: ZeRO's group is the DP group itself (one byte counter)
        mine["dp_cp"] = mine["dp"]
    if mine["expert_tp"].ranks == mine["tp"].ranks:  # ETP = TP: experts split over the TP group itself
        mine["expert_tp"] = mine["tp"]
    # the world's collectives too carry this run's timeout, whoever made the default group (a test harness)
    world = make([list(range(world_size))]) if world_size > 1 else CommGroup(dist.group.WORLD, (0,), 0)
    return ParallelGroups(world=world, device=device, **mine)


def _device_for_backend(backend: str) -> torch.device:
    """NCCL ranks compute on their local GPU (made current); gloo ranks on the CPU, even on a GPU host."""
    if "nccl" not in backend:  # also "cpu:gloo,cuda:nccl"
        return torch.device("cpu")
    device = torch.device("cuda", launcher_env().local_rank)
    torch.cuda.set_device(device)
    return device
