"""The disk tier's files are this run's alone: a symlink planted where a swap file or its folder goes is never
followed; a second run on the same --offload-path is refused (the holder's pid) while the first trains on to the
losses it has alone; a swap file deleted or cut short by someone else stops the next save in one line with no
checkpoint published; a full disk (ENOSPC) and a file-size limit (EFBIG, RLIMIT_FSIZE) are told apart, in
readable units, and leave no file behind; a dead run's folder is cleaned, a foreign one refused. Stage 3 with the
optimizer and the parameters on disk, so every kind of swap file is exercised, through `pretrain_gpt.main`."""

import errno
import multiprocessing as mp
import os
import re
import resource
import traceback

import pytest

from mpzero.checkpointing import latest_iteration
from mpzero.errors import ConfigError
from mpzero.zero.offload.swap import SwapFile
from mpzero.zero import ZeroOptimizer
from tests.cli import TINY, exit_code_and_stderr, quiet_main
from tests.distributed import run_ranks, start_method

RUN = TINY + ["--eval-iters", "0", "--train-iters", "6", "--zero-stage", "3", "--offload-optimizer", "disk",
              "--offload-params", "disk"]


def _argv(offload, *extra) -> list[str]:
    return RUN + ["--offload-path", str(offload), *extra]


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def _after_step(iteration: int, action):
    """Patch ZeroOptimizer.step (in this process: call it in a forked rank) to run action() after `iteration`."""
    real = ZeroOptimizer.step

    def step(self, lr=None):
        stats = real(self, lr)
        if self.iteration == iteration:
            action()
        return stats

    ZeroOptimizer.step = step


# ------------------------------------------------------------------ symlinks and foreign files
def test_a_swap_file_is_never_created_through_a_symlink_or_over_a_file(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    for planted in (tmp_path / "link.bin", tmp_path / "file.bin"):
        if planted.name == "link.bin":
            planted.symlink_to(victim)
        else:
            planted.write_bytes(b"mine")
        with pytest.raises(ConfigError, match="already exists"):
            SwapFile(str(planted), 8192, "buffered")
    assert victim.read_bytes() == b"precious" and (tmp_path / "file.bin").read_bytes() == b"mine"


@pytest.mark.parametrize("where", ["rank00000", "rank00000.lock", "rank00000/master.bin"])
def test_a_symlink_planted_in_the_offload_path_is_not_followed(tmp_path, where):
    """The run's folder or its lock as a symlink: refused in one line. A symlink by a swap file's name inside a
    folder left by a dead run: the link is removed (its target kept) and the run trains."""
    offload, victim = tmp_path / "swap", tmp_path / "victim"
    victim.mkdir()
    (victim / "master.bin").write_bytes(b"precious")
    (offload / "rank00000" if where.endswith(".bin") else offload).mkdir(parents=True)
    target = victim / "master.bin" if where != "rank00000" else victim
    (offload / where).symlink_to(target)
    code, stderr = run_ranks(1, exit_code_and_stderr, _argv(offload, "--train-iters", "2"))[0]
    if where.endswith(".bin"):
        assert code == 0, stderr
        assert sorted(os.listdir(offload)) == []  # cleaned at start, removed at close
    else:
        assert code == 2 and "symlink" in _one_line(stderr)
        assert os.path.islink(offload / where)  # not ours: left in place
    assert sorted(os.listdir(victim)) == ["master.bin"] and (victim / "master.bin").read_bytes() == b"precious"


def test_a_dead_runs_folder_is_cleaned_and_a_foreign_one_kept(tmp_path):
    offload = tmp_path / "swap"
    (offload / "rank00000").mkdir(parents=True)
    (offload / "rank00000" / "exp_avg.bin").write_bytes(b"\0" * 4096)  # a run killed with -9 leaves this
    (offload / "rank00000" / "grads.bin").write_bytes(b"\0" * 4096)
    (offload / "rank00000.lock").write_text("12345\n")  # no process holds it: its run is dead
    history, stdout = run_ranks(1, _main_with_stdout, _argv(offload, "--train-iters", "2"))[0]
    assert len(history["losses"]) == 2 and os.listdir(offload) == []
    assert f"note: removed {offload / 'rank00000'} (2 swap files)" in stdout
    (offload / "rank00000").mkdir()
    (offload / "rank00000" / "notes.txt").write_text("someone's")
    code, stderr = run_ranks(1, exit_code_and_stderr, _argv(offload, "--train-iters", "2"))[0]
    assert code == 2 and "'notes.txt', which mpzero does not create" in _one_line(stderr)
    assert (offload / "rank00000" / "notes.txt").read_text() == "someone's"


def _main_with_stdout(argv):
    import contextlib
    import io
    import pretrain_gpt
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        return pretrain_gpt.main(argv), out.getvalue()


# ------------------------------------------------------------------ a second run on the same path
def _paused_run(argv, conn):
    """A run of one that stops after iteration 2 until the parent says go; returns its losses."""
    _after_step(2, lambda: (conn.send("paused"), conn.recv()))
    return quiet_main(argv)["losses"]


def _reporting(fn, args, there):
    try:
        outcome = (True, fn(*args, there))
    except BaseException:  # noqa: BLE001 - report it to the parent
        outcome = (False, traceback.format_exc())
    there.send(("done", outcome))
    os._exit(0)


def _forked(fn, *args):
    """fn(*args, conn) in a process of its own, started as the harness starts ranks (tests/distributed.py);
    returns (process, the parent's end of the pipe)."""
    ctx = mp.get_context(start_method())
    here, there = ctx.Pipe()
    process = ctx.Process(target=_reporting, args=(fn, args, there))
    process.start()
    return process, here


def test_a_second_run_on_the_same_offload_path_is_refused_while_the_first_trains_on(tmp_path):
    offload = tmp_path / "swap"
    alone = run_ranks(1, quiet_main, _argv(tmp_path / "alone"))[0]["losses"]
    first, conn = _forked(_paused_run, _argv(offload))
    try:
        assert conn.poll(120) and conn.recv() == "paused"
        code, stderr = run_ranks(1, exit_code_and_stderr, _argv(offload))[0]
        line = _one_line(stderr)
        assert code == 2 and f"another run (pid {first.pid}) is using the offload folder" in line
        conn.send("go")
        assert conn.poll(120)
        _, (ok, losses) = conn.recv()
        assert ok, losses
    finally:
        first.join(30)
        if first.is_alive():
            first.kill()
    assert losses == alone
    assert os.listdir(offload) == []  # the first removed its folder and lock; the second created nothing


# ------------------------------------------------------------------ files vanished or cut short mid-training
def _tamper_and_train(argv, path, how, rank):
    import torch.distributed as dist
    if dist.get_rank() == rank:
        _after_step(4, lambda: os.unlink(path) if how == "delete" else os.truncate(path, 4096))
    return exit_code_and_stderr(argv)


@pytest.mark.parametrize("world,rank,name,how", [(1, 0, "exp_avg.bin", "delete"), (1, 0, "params.swap", "cut"),
                                                 (2, 1, "master.bin", "delete"), (1, 0, "grads.bin", "cut")])
def test_a_swap_file_deleted_or_cut_mid_training_stops_the_next_save(tmp_path, world, rank, name, how):
    """Saves at 2 and 4; after step 4 someone removes (or truncates) rank `rank`'s file: the save at 4 is refused
    on every rank in one line, exit 1, the latest pointer still on 2 and nothing of iteration 4 written."""
    offload, save = tmp_path / "swap", tmp_path / "ckpt"
    path = str(offload / f"rank{rank:05d}" / name)
    argv = _argv(offload, "--save", str(save), "--save-interval", "2", "--global-batch-size", str(4 * world))
    results = run_ranks(world, _tamper_and_train, argv, path, how, rank)
    for code, stderr in results:
        line = _one_line(stderr)
        assert code == 1 and f"the offload file {path} was" in line and "no checkpoint saved" in line
    assert latest_iteration(str(save)) == 2
    assert sorted(os.listdir(save)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert not os.path.exists(offload) or os.listdir(offload) == []  # closed and removed all the same


# ------------------------------------------------------------------ a full disk and a file-size limit
def _no_space(*args):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("where", ["fallocate", "write", "space check"])
def test_a_full_disk_says_enospc_in_readable_units_and_leaves_no_file(tmp_path, monkeypatch, where):
    offload = tmp_path / "swap"
    if where == "fallocate":
        monkeypatch.setattr(os, "posix_fallocate", _no_space)
    elif where == "write":  # the masters' first write at start
        monkeypatch.setattr(os, "pwritev", _no_space)
    else:
        monkeypatch.setattr(os, "fstatvfs", lambda fd: _Tiny())
    code, stderr = exit_code_and_stderr(_argv(offload, "--train-iters", "2"))
    line = _one_line(stderr)
    assert code in (1, 2) and re.search(r"needs \d+\.\d (KiB|MiB)", line) and "0.00 GiB" not in line, line
    assert ("ENOSPC" in line) != (where == "space check") and "--offload-path" in line
    assert os.listdir(offload) == []  # no half-made swap file, folder or lock


class _Tiny:
    """statvfs of a file system with 256 KiB free (the tiny model's files need more)."""

    f_frsize, f_bavail = 4096, 64


def _with_file_size_limit(argv, limit):
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    return exit_code_and_stderr(argv)


def test_a_file_size_limit_says_efbig_not_no_space_and_leaves_no_file(tmp_path):
    """RLIMIT_FSIZE of 64 KiB in a forked rank: mpzero ignores SIGXFSZ (else the kernel kills the process with no
    word), so preallocating the 136 KiB master file fails with EFBIG, named as the limit."""
    offload = tmp_path / "swap"
    code, stderr = run_ranks(1, _with_file_size_limit, _argv(offload), 64 << 10)[0]
    line = _one_line(stderr)
    assert code == 2 and "EFBIG" in line and "RLIMIT_FSIZE" in line and "64.0 KiB" in line, line
    assert "no space" not in line and "ENOSPC" not in line
    assert os.listdir(offload) == []
