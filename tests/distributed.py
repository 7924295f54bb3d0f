"""Run a function on N gloo ranks on one CPU machine, fast, with a deadline instead of a hang.

Ranks are forked (about 0.1 s each; spawning re-imports torch, 3-6 s), meet through a `FileStore` in a
temporary directory (no ports), and run with one intra-op thread (a forked child that starts a
multi-thread OpenMP pool after the parent used one can deadlock). On failure every rank's traceback
is reported, not only the first: the peers' "connection reset" otherwise hides the real assertion.

    results = run_ranks(world_size, fn, *args)   # fn(*args) runs on every rank, returns picklable data

Under a CUDA (or ROCm) build of torch, the autograd engine starts its device threads at a process's first
backward and then refuses to run in any process forked after that (PyTorch's "Autograd and Fork"), so
every rank after the test process's first backward would fail. There ranks are forked from a fork server
instead, a fresh process that never runs one: `fn` and its arguments must then pickle (module-level
functions), and the ranks get the test process's environment variables as they are at the call.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import shutil
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist


class RanksFailed(AssertionError):
    pass


def start_method() -> str:
    """How ranks start: "fork" under a CPU build of torch, "forkserver" under one with a GPU backend."""
    return "fork" if torch.version.cuda is None and torch.version.hip is None else "forkserver"


def run_ranks(world_size: int, fn, *args, deadline: float = 120.0, start: str | None = None, **kwargs) -> list:
    """fn(*args, **kwargs) on every rank of a fresh gloo world; returns the per-rank results in rank order.
    `start`: "fork" or "forkserver" (default: `start_method()`)."""
    start = start or start_method()
    ctx = mp.get_context(start)
    if start == "forkserver":
        # imported once, in the server, rather than by every rank
        ctx.set_forkserver_preload(["tests.distributed", "torch.distributed.checkpoint", "mpzero.models",
                                    "mpzero.zero", "mpzero.cli.arguments"])
    environment = dict(os.environ) if start != "fork" else None  # a fork inherits it
    store_dir = tempfile.mkdtemp(prefix="mpzero-store-")
    conns, procs = {}, {}
    try:
        for rank in range(world_size):  # from a fork server, a function that does not pickle stops here
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(rank, world_size, store_dir, deadline, send, fn, args, kwargs,
                                                    environment))
            proc.start()
            send.close()
            conns[recv], procs[rank] = rank, proc
        outcomes = _collect(conns, deadline)
    finally:
        for proc in procs.values():
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(store_dir, ignore_errors=True)
    failures = [f"--- rank {r} ---\n{detail}" for r, (ok, detail) in sorted(outcomes.items()) if not ok]
    for rank in range(world_size):
        if rank not in outcomes:
            failures.append(f"--- rank {rank} ---\nno result within {deadline:.0f} s (exit code {procs[rank].exitcode})")
    if failures:
        raise RanksFailed("\n".join(failures))
    return [outcomes[r][1] for r in range(world_size)]


def _collect(conns: dict, deadline: float) -> dict:
    outcomes, end = {}, time.monotonic() + deadline
    pending = list(conns)
    while pending and time.monotonic() < end:
        for conn in mp.connection.wait(pending, timeout=end - time.monotonic()):
            rank = conns[conn]
            try:
                outcomes[rank] = pickle.loads(conn.recv_bytes())
            except EOFError:
                outcomes[rank] = (False, "process died without reporting (killed or crashed)")
            pending.remove(conn)
    return outcomes


def _child(rank, world_size, store_dir, deadline, conn, fn, args, kwargs, environment):
    if environment is not None:
        os.environ.clear()
        os.environ.update(environment)
        tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), world_size)
    try:
        # Collectives give up a little before the parent's deadline so the child reports its traceback.
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=max(deadline - 10, 5)))
        outcome = (True, fn(*args, **kwargs))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit from a CLI
        outcome = (False, traceback.format_exc())
    try:
        conn.send_bytes(pickle.dumps(outcome))
    except Exception:  # noqa: BLE001 - an unpicklable result is itself a failure to report
        conn.send_bytes(pickle.dumps((False, traceback.format_exc())))
    finally:
        conn.close()
        _wait_for_peers(store, rank, world_size, deadline)
        os._exit(0)


def _wait_for_peers(store, rank: int, world_size: int, deadline: float) -> None:
    """Leave only when every rank has finished: a rank that exits while a peer is still connecting a
    new group's gloo mesh makes that peer fail with "connection closed by peer"."""
    try:
        store.set(f"finished/{rank}", "1")
        store.wait([f"finished/{r}" for r in range(world_size)], timedelta(seconds=deadline))
    except Exception:  # noqa: BLE001 - a peer that never finishes is reported by the parent's deadline
        pass  # skip the parent's atexit handlers (pytest's) inherited through fork
