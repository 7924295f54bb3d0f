"""A real kill: SIGKILL a training process that saves every iteration, at moments spread over the save
cycle, and check each time that the latest pointer names a complete checkpoint that loads and trains on.
(test_checkpointing.py stops a save deterministically right before publication; this one does it for real.)

A kill that lands between saves proves little, so the test insists that at least MID_SAVE_KILLS of them land
while a save is being written (an `iter_*.tmp` directory newer than the latest checkpoint is left behind):
after the kills spread over the cycle it aims further kills at saves as they begin, up to MAX_KILLS in all."""

import os
import signal
import subprocess
import sys
import time

import pytest

from mpzero.checkpointing import latest_iteration
from tests.cli import ROOT, TINY, main_capturing_stdout
from tests.distributed import run_ranks

MID_SAVE_KILLS = 2
MAX_KILLS = 12
SPREAD = (0.00, 0.05, 0.11, 0.17)  # seconds after a save is published: through the next iteration and its save


def _saves_under_way(root, after: int) -> list[str]:
    """The temporary directories of saves of iterations later than `after`."""
    return [name for name in os.listdir(root) if name.startswith("iter_") and name.endswith(".tmp")
            and name[len("iter_"):-len(".tmp")].isdigit() and int(name[len("iter_"):-len(".tmp")]) > after
            and os.path.isdir(os.path.join(root, name))]


def _wait_until(condition, proc, deadline, poll):
    while not condition():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "the training process made no progress within its deadline"
        time.sleep(poll)


@pytest.mark.slow
def test_sigkill_at_any_moment_leaves_a_loadable_checkpoint(tmp_path):
    root = str(tmp_path)
    argv = TINY + ["--train-iters", "100000", "--eval-iters", "0", "--save", root, "--save-interval", "1",
                   "--log-interval", "1000"]
    kills = mid_save = 0
    while kills < MAX_KILLS and (kills < len(SPREAD) or mid_save < MID_SAVE_KILLS):
        proc = subprocess.Popen([sys.executable, "pretrain_gpt.py", *argv, "--load", root], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + 120
        start = latest_iteration(root) or 0
        # a few saves in, so that the next one is under way
        _wait_until(lambda: (latest_iteration(root) or 0) >= start + 3, proc, deadline, 0.01)
        if kills < len(SPREAD):
            time.sleep(SPREAD[kills])
        else:  # aim at a save: as soon as the next one has begun, a little later each time
            published = latest_iteration(root)
            _wait_until(lambda: _saves_under_way(root, published), proc, deadline, 0.001)
            time.sleep(0.003 * (kills - len(SPREAD)))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
        kills += 1
        latest = latest_iteration(root)
        mid_save += bool(_saves_under_way(root, latest))
        history, stdout = run_ranks(1, main_capturing_stdout, argv + ["--load", root, "--train-iters",
                                                                      str(latest + 1)])[0]
        assert f"at iteration {latest}" in stdout and len(history["losses"]) == 1
        assert not _saves_under_way(root, latest), os.listdir(root)  # saving latest + 1 cleared a stale one
    print(f"{mid_save} of {kills} kills landed while a save was being written")
    assert mid_save >= MID_SAVE_KILLS, f"only {mid_save} of {kills} kills landed while a save was being written"
