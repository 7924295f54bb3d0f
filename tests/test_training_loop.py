"""The training loop around the step: schedule, --config files, TensorBoard, SIGTERM, NaN, exit interval."""

import json
import math
import os
import re
import signal
import threading

import pytest

from tests.cli import TINY, exit_code_and_stderr, main_capturing_stdout, quiet_main
from tests.distributed import run_ranks


def _run(argv, world=1):
    return run_ranks(world, quiet_main, argv)[0]


def test_warmup_cosine_lrs_follow_the_closed_form():
    history = _run(TINY + ["--lr-decay-style", "cosine", "--lr-warmup-iters", "3", "--min-lr", "1e-4"])
    # Megatron's formula written out (decay over TINY's 10 train iterations): linear warmup from 0 over
    # 3 steps, then min_lr + (max_lr - min_lr) * 0.5 * (1 + cos(pi * (step - 3) / (10 - 3))).
    max_lr, min_lr, warmup, decay = 1e-3, 1e-4, 3, 10
    expected = [max_lr * step / warmup if step <= warmup else
                min_lr + (max_lr - min_lr) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (decay - warmup)))
                for step in range(10)]
    assert history["lrs"] == pytest.approx(expected, rel=1e-12, abs=0)
    # A few by hand: warmup 0, 1/3, 2/3 and all of max_lr at step 3; step 9 is 6/7 of the way along the cosine.
    assert history["lrs"][:4] == pytest.approx([0.0, 1e-3 / 3, 2e-3 / 3, 1e-3], rel=1e-12, abs=0)
    assert history["lrs"][9] == pytest.approx(1e-4 + 9e-4 * 0.5 * (1 + math.cos(math.pi * 6 / 7)), rel=1e-12)


def test_skipped_fp16_steps_match_megatron_schedule_and_console():
    """Megatron advances the schedule only on applied updates and counts skipped iterations per log line."""
    history, stdout = run_ranks(1, main_capturing_stdout, TINY + ["--fp16", "--initial-loss-scale", "1048576",
                                                                  "--log-interval", "2", "--eval-iters", "0"])[0]
    skipped = [norm is None for norm in history["grad_norms"]]
    assert skipped[:2] == [True, True] and not all(skipped)  # 2^20 overflows fp16 until the scale backs off
    # Megatron's linear decay without warmup, to min_lr 0 over 10 iterations: lr = 1e-3 * (1 - step / 10),
    # where step counts only the updates applied before iteration i.
    applied = [i - sum(skipped[:i]) for i in range(10)]
    assert applied[:3] == [0, 0, 0]  # two skipped iterations: the third still runs at step 0
    assert history["lrs"] == pytest.approx([1e-3 * (1 - step / 10) for step in applied], rel=1e-12, abs=0)
    per_line = [int(n) for n in re.findall(r"number of skipped iterations: +(\d+)", stdout)]
    assert per_line == [sum(skipped[i:i + 2]) for i in range(0, 10, 2)]


def _main_without_a_process_group(argv):
    import torch.distributed as dist
    dist.destroy_process_group()  # as plain `python pretrain_gpt.py` starts
    quiet_main(argv)
    return dist.is_initialized()


def test_main_destroys_the_process_group_it_created():
    assert run_ranks(1, _main_without_a_process_group, TINY + ["--train-iters", "1", "--eval-iters", "0"]) == [False]


def test_config_file_sets_flags_and_command_line_wins(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("lr-decay-style: constant\nlr: 0.5\ntrain-iters: 3\n")
    history = _run(TINY + ["--config", str(config), "--lr", "0.002"])
    assert history["lrs"] == [0.002] * 10  # TINY's --train-iters 10 beats the file; --lr from the command line
    (tmp_path / "run.json").write_text(json.dumps({"lr_decay_style": "constant", "train-iters": 2}))
    argv = [a for a in TINY if a not in ("--train-iters", "10")]
    assert len(_run(argv + ["--config", str(tmp_path / "run.json")])["losses"]) == 2


def test_unknown_config_key_is_a_one_line_error(tmp_path):
    (tmp_path / "bad.yaml").write_text("hiden-size: 3\n")
    code, stderr = run_ranks(1, exit_code_and_stderr, TINY + ["--config", str(tmp_path / "bad.yaml")])[0]
    assert code == 2 and stderr == (f"error: --config {tmp_path / 'bad.yaml'}: unknown flag 'hiden-size': "
                                    f"did you mean 'hidden-size'?\n")


def test_nan_loss_stops_with_iteration_and_rank():
    results = run_ranks(2, exit_code_and_stderr, TINY + ["--lr", "1e30", "--clip-grad", "0"])
    for rank, (code, stderr) in enumerate(results):
        assert code == 1
        assert stderr.startswith("error: lm loss is nan at iteration ") and f"(rank {rank})" in stderr


def test_tensorboard_has_megatron_tags(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run_ranks(2, quiet_main, TINY + ["--tensorboard-dir", str(tmp_path)])
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "grad-norm", "lm loss validation", "lm loss validation ppl",
            "iteration-time", "batch-size", "throughput", "mem-max-bytes/rank-0", "mem-max-bytes/rank-1"} <= tags
    assert [e.step for e in events.Scalars("lm loss")] == list(range(1, 11))
    assert len(os.listdir(tmp_path)) == 1, "only one rank writes"


def _sigterm_rank1_after(delay, argv):
    import torch.distributed as dist
    if dist.get_rank() == 1:
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGTERM)).start()
    return len(quiet_main(argv)["losses"])


def test_sigterm_on_one_rank_stops_every_rank_at_the_same_iteration():
    argv = TINY + ["--train-iters", "100000", "--eval-iters", "0"]
    stopped_at = run_ranks(2, _sigterm_rank1_after, 1.0, argv)
    assert stopped_at[0] == stopped_at[1] < 100000


def test_exit_interval_stops_early():
    assert len(_run(TINY + ["--exit-interval", "4"])["losses"]) == 4
