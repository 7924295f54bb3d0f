"""The save protocol (checkpoint.py's docstring) proven step by step instead of sampled.

In process: a save is stopped at its k-th file-system step, for every k until it completes (each file's
creation and first two writes, each fsync, rename, mkdir and deletion, DCP's included; tests/save_steps.py), the
way a kill stops it: from that step on every file-system call raises, so no handler cleans up after it. After each
stop: the latest pointer names a complete checkpoint (verify passes, it loads the values saved at that iteration),
it is the new one exactly when the pointer's rename was reached, every published `iter_N` is complete, and the
next save leaves nothing half-written.
The same trace shows the order is durable against a power cut too: when the pointer is renamed, every file of the
checkpoint, every directory entry leading to it and the pointer's bytes have been fsynced.

Three starting points: the next iteration; an iteration whose directory a killed save renamed into place
without moving the pointer (the common case after a kill: the resumed run saves it again); the latest one again.
Slow: real `kill -9`s of training processes that save every iteration, while other processes load the CPU.
"""

import builtins
import contextlib
import io
import multiprocessing
import os
import random
import shutil
import signal
import time
from collections import Counter

import pytest

from mpzero.cli.arguments import parse_args, run_config
from mpzero.checkpointing import LATEST, latest_iteration, load_checkpoint, save_checkpoint
from mpzero.checkpointing.verify import single_process, verify_checkpoint
from mpzero.parallel import init_parallel
from mpzero.training import build_training_state
import pretrain_gpt
from tests.cli import TINY, main_capturing_stdout
from tests.save_steps import FileSystem
from tests.distributed import run_ranks, start_method

META = {"consumed_samples": 0, "skipped_iterations": 0}


def _training_state(argv):
    import torch.distributed as dist
    run = run_config(parse_args(argv), dist.get_world_size())
    groups = init_parallel(run.parallel.tensor_model_parallel_size)
    state = build_training_state(run, pretrain_gpt.gpt_provider, groups)
    return groups, state.model.module, state.optimizer, state.rng


SCENARIOS = {  # name: (iterations saved before, the pointer's, the iteration saved and the value it holds)
    "next": ((1,), 1, 2, 2.0),
    "over an unpublished one": ((1, 2), 1, 2, 12.0),  # iter_0000002 complete, the pointer still on 1
    "the latest again": ((1, 2), 2, 2, 12.0),  # a run that loaded 2 saves 2 again
}


def _holding(optimizer, value):
    """The optimizer state to save: every master weight and Adam moment equal to `value`."""
    for piece in optimizer.owned_pieces():
        for tensor in piece.tensors.values():
            tensor.fill_(value)
    optimizer.load_owned_pieces()
    return optimizer


def _save(root, iteration, value, state):
    groups, model, optimizer, rng = state
    save_checkpoint(root, iteration, model, _holding(optimizer, value), rng, groups, META)


def _loaded(root, state):
    """(iteration, the one value every master and moment holds) of what resuming from `root` loads."""
    groups, model, optimizer, rng = state
    meta = load_checkpoint(root, model, _holding(optimizer, -1.0), rng, groups)
    values = {t.unique().item() for piece in optimizer.owned_pieces() for t in piece.tensors.values()}
    assert len(values) == 1, values
    return meta["iteration"], values.pop()


def _verified(root, names=()):
    """The published names (`iter_N`) under `root`, each but `names` checked to hold a complete checkpoint."""
    published = {n for n in os.listdir(root) if n.startswith("iter_") and n[len("iter_"):].isdigit()}
    with single_process():
        for name in sorted(published - set(names)):
            verify_checkpoint(root, int(name[len("iter_"):]))
    return published


def _stop_at_every_step(base, scenario, state):
    """Outcomes of a save stopped at each of its steps in turn (k = 1, 2, ... until one completes)."""
    saved, pointer, iteration, value = SCENARIOS[scenario]
    template, root = os.path.join(base, "template"), os.path.join(base, "save")
    for n in saved:
        _save(template, n, float(n), state)
    with builtins.open(os.path.join(template, LATEST), "w") as f:
        f.write(str(pointer))
    before = _loaded(template, state)
    outcomes = Counter()
    # the disk's own fsyncs would take most of the time, and a kill does not need them: FileSystem models them
    fast = pytest.MonkeyPatch()
    fast.setattr(os, "fsync", lambda fd: None)
    for k in range(1, 1000):
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(template, root)
        with pytest.MonkeyPatch.context() as mp:
            fs = FileSystem(mp, root, crash_at=k)
            try:
                _save(root, iteration, value, state)
            except BaseException:  # noqa: BLE001 - Crash, or what DCP or a handler made of it
                if fs.steps < k:
                    raise
        where = (scenario, k, fs.trace[-3:])
        done = fs.steps < k
        # published: the pointer renamed, or for the same iteration again, its directory
        published = done or ("directory renamed" if pointer == iteration else "pointer renamed") in fs.trace
        assert latest_iteration(root) == (iteration if published else pointer), where
        assert _loaded(root, state) == ((iteration, value) if published else before), where
        names = _verified(root)
        _save(root, iteration + 1, 0.0, state)  # the next save: complete, so not verified again
        names |= {f"iter_{iteration + 1:07d}"}
        assert sorted(os.listdir(root)) == sorted(_verified(root, names) | {LATEST}), where
        outcomes["new" if published else "previous"] += 1
        if done:  # and a power cut after the pointer's rename loses nothing of the checkpoint it names
            assert fs.unsynced_publications == [[]], fs.unsynced_publications
            assert (os.stat(root).st_ino, LATEST) not in fs.dirty_entries
            fast.undo()
            return {**outcomes, "steps": dict(fs.kinds)}
    raise AssertionError(f"{scenario}: the save did not complete within 1000 steps")


def _stop_at_every_step_of_a_run(root, scenario, argv):
    return _stop_at_every_step(root, scenario, _training_state(argv))


@pytest.mark.parametrize("scenario", [  # a second save of the same iteration: the same steps as "over an unpublished one"
    pytest.param(name, marks=pytest.mark.product) if name == "the latest again" else name for name in SCENARIOS])
def test_a_save_stopped_at_any_step_leaves_the_last_published_checkpoint(tmp_path, scenario):
    argv = TINY + ["--num-layers", "1", "--vocab-size", "256"]  # no vocabulary padding: every value is stored
    outcomes = run_ranks(1, _stop_at_every_step_of_a_run, str(tmp_path), scenario, argv)[0]
    print(scenario, outcomes)


KILLS = 50


def _train(argv):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        pretrain_gpt.main(argv)


def _spin():
    while True:
        pass


def _killed_during(root, latest):
    """Where the kill landed: in the save of an iteration after `latest` (its `.tmp`, or its directory renamed
    and the pointer not yet), or between saves."""
    later = [n for n in os.listdir(root) if n.startswith("iter_") and int(n[5:12]) > latest]
    if any(n.endswith(".tmp") for n in later):
        return "while writing"
    return "before the pointer" if later else "between saves"


@pytest.mark.product  # fifty kills under load: ~30 s; make test keeps test_checkpoint_kill's SIGKILLs
def test_kill_9_under_cpu_load_leaves_the_last_published_checkpoint(tmp_path):
    """Real SIGKILLs of a run that saves every iteration, at random moments, two busy processes beside it."""
    root, rng = str(tmp_path / "save"), random.Random(0)
    argv = TINY + ["--num-layers", "1", "--vocab-size", "256", "--train-iters", "100000", "--eval-iters", "0",
                   "--save", root, "--save-interval", "1", "--log-interval", "100000"]
    ctx = multiprocessing.get_context(start_method())  # fork: ~0.1 s a run, torch already imported
    load = [ctx.Process(target=_spin, daemon=True) for _ in range(2)]
    for proc in load:
        proc.start()
    outcomes, verified, latest = Counter(), set(), 0
    try:
        for kill in range(KILLS):
            run = ctx.Process(target=_train, args=(argv + (["--load", root] if latest else []),))
            run.start()
            deadline = time.monotonic() + 60
            while (latest_iteration(root) or 0) <= latest:  # resumed from `latest` and published a new save
                assert run.exitcode is None and time.monotonic() < deadline, f"kill {kill}: no progress"
                time.sleep(0.005)
            time.sleep(rng.uniform(0, 0.2))
            os.kill(run.pid, signal.SIGKILL)
            run.join()
            latest = latest_iteration(root)
            outcomes[_killed_during(root, latest)] += 1
            with single_process():
                verify_checkpoint(root)
            # every published name holds a complete checkpoint (each directory once; earlier ones dropped)
            names = {(n, os.stat(os.path.join(root, n)).st_ino) for n in os.listdir(root) if n[5:].isdigit()}
            _verified(root, {n for n, _ in names & verified})
            verified = names
            for name, _ in names:
                if int(name[5:]) < latest:
                    shutil.rmtree(os.path.join(root, name))
    finally:
        for proc in load:
            proc.kill()
            proc.join()
    _, stdout = run_ranks(1, main_capturing_stdout, argv + ["--load", root, "--train-iters", str(latest + 1)])[0]
    assert f"at iteration {latest}" in stdout
    assert sorted(os.listdir(root)) == sorted([LATEST, f"iter_{latest:07d}", f"iter_{latest + 1:07d}"])
    print(f"{KILLS} kills: {dict(outcomes)}")
    assert outcomes["while writing"] + outcomes["before the pointer"] >= KILLS // 5, outcomes
