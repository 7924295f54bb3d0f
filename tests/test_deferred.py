"""The loop with launched steps (mpzero/training/deferred.py): what it reads when, a non-finite loss named at its
iteration when the next log line reads it (the updates since skipped on the device, the checkpoints intact), and
SIGTERM acted on at a read, the same iteration on every rank."""

import os
import signal
import threading

from mpzero.checkpointing import latest_iteration
from mpzero.training.deferred import must_read
from tests.cli import TINY, exit_code_and_stderr, quiet_main
from tests.distributed import run_ranks

RUN = TINY + ["--eval-iters", "0", "--attention-backend", "local", "--log-interval", "5"]
# --lr 1e4 explodes the weights: the loss of iteration 4 is nan (tests/test_hardening.py)
EXPLODING = RUN + ["--lr", "1e4", "--clip-grad", "0", "--train-iters", "30"]


def test_the_loop_reads_at_its_decisions_only():
    from types import SimpleNamespace as S
    run = S(logging=S(log_interval=5), evaluation=S(eval_interval=4, eval_iters=1),
            checkpoint=S(save_interval=None), training=S(exit_interval=None, train_iters=13))
    assert [i for i in range(1, 14) if must_read(run, i)] == [4, 5, 8, 10, 12, 13]
    run.evaluation.eval_iters = 0  # no evaluation: its interval is no decision
    assert [i for i in range(1, 14) if must_read(run, i)] == [5, 10, 13]


def test_a_non_finite_loss_is_named_at_its_iteration_when_the_log_line_reads_it(tmp_path):
    code, stderr = run_ranks(1, exit_code_and_stderr, EXPLODING)[0]
    assert code == 1 and stderr.count("\n") == 1
    assert stderr.startswith("error: lm loss is nan at iteration 4 (rank 0), read at iteration 5: its update and "
                             "the 1 after it were skipped on the device"), stderr
    code, synchronising = run_ranks(1, exit_code_and_stderr, EXPLODING + ["--sync-every-iteration"])[0]
    assert code == 1 and synchronising.startswith("error: lm loss is nan at iteration 4 (rank 0): stopped before")


def test_a_checkpoint_reads_first_so_the_stop_comes_before_it(tmp_path):
    argv = EXPLODING + ["--save", str(tmp_path), "--save-interval", "2"]
    code, stderr = run_ranks(1, exit_code_and_stderr, argv)[0]
    assert code == 1 and "lm loss is nan at iteration 4 (rank 0): stopped before the update" in stderr
    assert latest_iteration(str(tmp_path)) == 2


def _sigterm_rank1_after(delay, argv):
    import torch.distributed as dist
    if dist.get_rank() == 1:
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGTERM)).start()
    return len(quiet_main(argv)["losses"])


def test_sigterm_stops_every_rank_at_the_same_read():
    stopped_at = run_ranks(2, _sigterm_rank1_after, 1.0, RUN + ["--train-iters", "100000"])
    assert stopped_at[0] == stopped_at[1] < 100000 and stopped_at[0] % 5 == 0
