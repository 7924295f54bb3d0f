"""Point-to-point between the CPU ranks of one host through shared memory: a pipeline's activations and gradients.

Why not gloo alone: gloo, torch's CPU backend, has no shared-memory transport for point-to-point (a shared-memory
allreduce, pytorch/gloo#455, is for collectives, and the gloo group measured here sends those over TCP loopback too).
A message crosses TCP loopback, moved by gloo's I/O threads, which on a host whose cores all compute must wait for
one: 2.2-3.5 ms of critical path per 1 MiB activation on two cores, against 0.6-1.4 ms through shared memory, copied
by the ranks' own threads (bench/README.md, pipeline). The files (`map_shared_files`) and the waits (`wait_for`)
serve the sums and gathers of comm_shm_collectives.py too.

Layout: for every pair of ranks that exchange (`peers`), each direction and every tag, a ring of `slots` messages of
at most `nbytes` each, in a file the receiver creates in /dev/shm (O_EXCL, mode 0600, a random name, its whole size
allocated at once, so that a full /dev/shm fails here and not as a SIGBUS later). The sender opens it (O_NOFOLLOW,
checked to be a regular file of this user and of that size); once every rank has mapped its rings the receivers
unlink their files, so nothing is left behind when a rank is killed. A ring has two counters, each on its own cache
line: the messages written (the sender's) and read (the receiver's). A message is copied into its slot before the
written counter moves, an order x86-64's stores keep (other machines keep gloo). A send that finds its ring full is
queued and written while the rank waits for any request of the channel, so waiting for one tag never stalls another.
Waits poll (yielding the core for a millisecond, then 50 us sleeps) and fail once the peer's process has exited
(looked at every second) or after the group's timeout: never a hang.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import socket
import stat
import time
from collections import deque

import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"
_LINE = 64  # the counters on cache lines of their own
_SPIN_SECONDS = 1e-3
_SLEEP_SECONDS = 50e-6


class P2PTimeout(dist.DistError):
    """A peer that stopped: it exited, or sent nothing for the group's timeout (a DistError, as gloo's are)."""


def _ring_bytes(nbytes: int, slots: int) -> int:
    return 2 * _LINE + slots * _slot_bytes(nbytes)


def _slot_bytes(nbytes: int) -> int:
    return -(-nbytes // _LINE) * _LINE


class _Ring:
    """One direction, one tag: `slots` messages in a mapped file."""

    def __init__(self, mapped: mmap.mmap, offset: int, nbytes: int, slots: int):
        self.slots, self.slot_bytes = slots, _slot_bytes(nbytes)
        # plain memory loads and stores (not tensors: reading one is no device sync, and counts as none)
        self.counters = memoryview(mapped)[offset:offset + 2 * _LINE].cast("q")
        self.data = torch.frombuffer(mapped, dtype=torch.uint8, count=slots * self.slot_bytes,
                                     offset=offset + 2 * _LINE)

    @property
    def written(self) -> int:
        return self.counters[0]

    @written.setter
    def written(self, value: int) -> None:
        self.counters[0] = value

    @property
    def read(self) -> int:
        return self.counters[_LINE // 8]

    @read.setter
    def read(self, value: int) -> None:
        self.counters[_LINE // 8] = value

    def slot(self, seq: int, nbytes: int) -> torch.Tensor:
        start = (seq % self.slots) * self.slot_bytes
        return self.data[start:start + nbytes]


class _Request:
    def __init__(self, channel: SharedMemoryP2P, tensor: torch.Tensor, peer: int, tag: int, seq: int):
        self.channel, self.tensor, self.peer, self.tag, self.seq = channel, tensor, peer, tag, seq
        self.done = False

    def wait(self) -> None:
        self.channel._wait(self)


class SharedMemoryP2P:
    """A group's point-to-point through shared memory (`open_shared_memory_p2p`). Peers are group ranks; tags
    0..tags-1 are separate rings, matched in order, as gloo matches a tag's messages."""

    def __init__(self, rank: int, recv_rings: dict, send_rings: dict, nbytes: int, timeout: float, maps: list,
                 pids: dict[int, int]):
        self.rank, self.nbytes, self.timeout, self.pids = rank, nbytes, timeout, pids
        self._recv_rings, self._send_rings = recv_rings, send_rings
        self._maps = maps  # the mappings, for as long as the rings' views of them live
        # a ring's next message number: its counter (moved only by this rank) plus what is queued behind it
        self._sends = {key: deque() for key in send_rings}  # queued, not yet in their ring
        self._recvs = {key: deque() for key in recv_rings}  # posted, not yet copied out

    def exchange(self, sends, recvs, tags) -> list[_Request]:
        """sends / recvs: (contiguous CPU tensor, group rank); tags: one per send then receive."""
        requests = []
        for (tensor, peer), tag in zip(sends, tags):
            key = self._key(self._send_rings, tensor, peer, tag)
            seq = self._send_rings[key].written + len(self._sends[key])
            requests.append(_Request(self, tensor, peer, tag, seq))
            self._sends[key].append(requests[-1])
        for (tensor, peer), tag in zip(recvs, tags[len(sends):]):
            key = self._key(self._recv_rings, tensor, peer, tag)
            seq = self._recv_rings[key].read + len(self._recvs[key])
            requests.append(_Request(self, tensor, peer, tag, seq))
            self._recvs[key].append(requests[-1])
        self._progress()
        return requests

    def _key(self, rings: dict, tensor: torch.Tensor, peer: int, tag: int) -> tuple[int, int]:
        if (peer, tag) not in rings:
            raise ValueError(f"no shared-memory ring with group rank {peer}, tag {tag} (rank {self.rank})")
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device.type != "cpu" or nbytes > self.nbytes:
            raise ValueError(f"a {tensor.device.type} tensor of {nbytes} bytes "
                             f"for a channel of CPU messages of at most {self.nbytes} bytes")
        return peer, tag

    def _progress(self) -> None:
        """Writes the queued sends that have room and copies out the receives that have arrived, each ring in
        order."""
        for key, queue in self._sends.items():
            ring = self._send_rings[key]
            while queue and queue[0].seq - ring.read < ring.slots:
                request = queue.popleft()
                data = request.tensor.reshape(-1).view(torch.uint8)
                ring.slot(request.seq, data.numel()).copy_(data)
                ring.written = request.seq + 1
                request.done, request.tensor = True, None
        for key, queue in self._recvs.items():
            ring = self._recv_rings[key]
            while queue and ring.written > queue[0].seq:
                request = queue.popleft()
                data = request.tensor.reshape(-1).view(torch.uint8)
                data.copy_(ring.slot(request.seq, data.numel()))
                ring.read = request.seq + 1
                request.done = True

    def _wait(self, request: _Request) -> None:
        def arrived() -> bool:
            self._progress()
            return request.done

        what = f"group rank {request.peer} (tag {request.tag}, message {request.seq}) through shared memory"
        wait_for(arrived, what, f"rank {self.rank} of the pipeline", self.timeout, self.pids, [request.peer])


def _exited(pid: int) -> bool:
    """Gone or a zombie (its parent has not reaped it yet); a process this host cannot see counts as alive."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return os.path.isdir("/proc/self")
    except (OSError, IndexError):
        return False


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _host() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def shared_memory_usable() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and os.path.isdir(SHM_DIR)


def open_shared_memory_p2p(group, nbytes: int, tags: int, timeout: float, slots: int = 2, peers=None):
    """Every rank of `group` (a CommGroup) calls this. Returns (SharedMemoryP2P, None) when its ranks share one
    host and /dev/shm takes the rings, else (None, why); every rank gets the same answer. `peers`: the group ranks
    this one exchanges with (a pipeline's two neighbours; a in b's peers when b is in a's), default all."""
    peers = sorted(set(range(group.size) if peers is None else peers) - {group.rank})
    mapped, why = map_shared_files(group, peers, tags * _ring_bytes(nbytes, slots))
    if mapped is None:
        return None, why
    created, opened, watched = mapped
    ring = _ring_bytes(nbytes, slots)
    recv_rings = {(s, t): _Ring(m, t * ring, nbytes, slots) for s, m in created.items() for t in range(tags)}
    send_rings = {(r, t): _Ring(m, t * ring, nbytes, slots) for r, m in opened.items() for t in range(tags)}
    maps = list(created.values()) + list(opened.values())
    return SharedMemoryP2P(group.rank, recv_rings, send_rings, nbytes, timeout, maps, watched), None


def map_shared_files(group, peers: list[int], size: int, one_file: bool = False):
    """Every rank of `group` calls this. Each rank makes a file of `size` bytes for each of its `peers` (or one for
    them all: `one_file`) and maps the one each peer made for it. Returns (({peer: the mapping this rank made},
    {peer: the mapping that peer made}, {peer: its PID where this process can watch it}), None), or (None, why)
    on every rank alike when the ranks are not on one x86-64 host or /dev/shm cannot hold the files."""
    found = group.all_gather_objects((_host() if shared_memory_usable() else None, os.getpid(), _pid_namespace()))
    hosts, pids, namespaces = [f[0] for f in found], [f[1] for f in found], [f[2] for f in found]
    if None in hosts or len(set(hosts)) != 1:
        return None, "the ranks are not all on one x86-64 host with /dev/shm"
    made: list[tuple[str, mmap.mmap]] = []
    created: dict[int, mmap.mmap] = {}

    def create():
        for peer in peers:
            if not one_file or not made:
                made.append(_create(size))
            created[peer] = made[-1][1]
        return {peer: os.path.basename(made[-1 if one_file else i][0]) for i, peer in enumerate(peers)}

    names, error = group.run_agreed(create, (OSError,), describe=lambda e: f"{type(e).__name__}: {e}")
    opened: dict[int, mmap.mmap] = {}
    if error is None:
        every = group.all_gather_objects(names)

        def attach():
            for peer in peers:
                opened[peer] = _attach(os.path.join(SHM_DIR, every[peer][group.rank]), size)

        _, error = group.run_agreed(attach, (OSError, ValueError), describe=lambda e: f"{type(e).__name__}: {e}")
    for path, _ in made:  # mapped by every peer, or given up: the names go either way
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    if error is not None:
        return None, f"shared memory in {SHM_DIR} unusable ({error})"
    # peers' processes watched where this one sees them (not from another PID namespace: then the timeout alone);
    # a peer that has already exited is watched too, so its first wait fails within seconds
    mine = namespaces[group.rank]
    watched = {peer: pids[peer] for peer in peers if mine is not None and namespaces[peer] == mine}
    return (created, opened, watched), None


def wait_for(ready, what: str, who: str, timeout: float, watched: dict[int, int], peers) -> None:
    """Polls `ready()` until it holds: yielding the core to any other runnable process for a millisecond, then in
    50 us sleeps. P2PTimeout after `timeout` seconds, or within about a second once a process of `peers` in `watched`
    has exited."""
    started = looked = time.monotonic()
    while not ready():
        now = time.monotonic()
        waited = now - started
        if waited > timeout:
            raise P2PTimeout(f"{who} waited {timeout:.0f} s for {what}: that rank stopped or is stuck, timed out")
        if now - looked > 1.0:
            looked = now
            for peer in peers:
                if peer in watched and _exited(watched[peer]):
                    raise P2PTimeout(f"{who} waits for {what}, whose process {watched[peer]} has exited")
        if waited < _SPIN_SECONDS:
            os.sched_yield()  # a rank of this host that still computes may need this core
        else:
            time.sleep(_SLEEP_SECONDS)


def _create(size: int) -> tuple[str, mmap.mmap]:
    path = os.path.join(SHM_DIR, f"mpzero-shm-{secrets.token_hex(16)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)  # every page now, or ENOSPC now (not a SIGBUS mid-run)
        return path, mmap.mmap(fd, size)
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def _attach(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_size != size:
            raise ValueError(f"{path} is not the {size}-byte file of this user its receiver made")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)
