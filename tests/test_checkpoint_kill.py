"""A real kill: SIGKILL a training process that saves every iteration, at moments spread over the save
cycle, and check each time that the latest pointer names a complete checkpoint that loads and trains on.
(test_checkpointing.py stops a save deterministically right before publication; this one does it for real.)"""

import os
import signal
import subprocess
import sys
import time

import pytest

from mpzero.checkpointing import latest_iteration
from tests.cli import ROOT, TINY, main_capturing_stdout
from tests.distributed import run_ranks


@pytest.mark.slow
def test_sigkill_at_any_moment_leaves_a_loadable_checkpoint(tmp_path):
    argv = TINY + ["--train-iters", "100000", "--eval-iters", "0", "--save", str(tmp_path), "--save-interval", "1",
                   "--log-interval", "1000"]
    killed_mid_save = 0
    for delay in (0.00, 0.05, 0.11, 0.17):
        proc = subprocess.Popen([sys.executable, "pretrain_gpt.py", *argv, "--load", str(tmp_path)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + 120
        start = latest_iteration(str(tmp_path)) or 0
        while (latest_iteration(str(tmp_path)) or 0) < start + 3:  # a few saves in, so the next one is under way
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
            time.sleep(0.01)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
        latest = latest_iteration(str(tmp_path))
        killed_mid_save += any(name.endswith(".tmp") for name in os.listdir(tmp_path))
        history, stdout = run_ranks(1, main_capturing_stdout, argv + ["--load", str(tmp_path), "--train-iters",
                                                                      str(latest + 1)])[0]
        assert f"at iteration {latest}" in stdout and len(history["losses"]) == 1
    print(f"{killed_mid_save} of 4 kills landed while a save was being written")
