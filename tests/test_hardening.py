"""A careful user's worst day, training side: a checkpoint of another architecture with the same shapes, a
gradient norm that blows up before the update, --save over another run's checkpoints, partial directories
left by killed saves, a full disk during a save, a resume in another precision or at another batch size, and
SIGTERM during a run that evaluates at its end. Each case fails in one line, or goes on as stated."""

import json
import os
import runpy
import signal
import subprocess
import threading

import numpy as np
import pytest
import torch

from mpzero.checkpointing import latest_iteration
from tests.cli import ROOT, TINY, exit_code_and_stderr, main_capturing_stdout, quiet_main
from tests.distributed import run_ranks

preprocess_main = runpy.run_path(os.path.join(ROOT, "tools", "preprocess_data.py"))["main"]

RUN = TINY + ["--eval-iters", "0"]


def _one(fn, *args):
    return run_ranks(1, fn, *args)[0]


def test_a_checkpoint_of_another_architecture_with_the_same_shapes_is_refused(tmp_path):
    _one(quiet_main, RUN + ["--save", str(tmp_path), "--train-iters", "2"])  # 4 heads of 8
    code, stderr = _one(exit_code_and_stderr, RUN + ["--load", str(tmp_path), "--num-attention-heads", "8"])
    assert code == 2 and stderr.count("\n") == 1
    assert "was saved with --num-attention-heads 4, this run has 8" in stderr
    code, stderr = _one(exit_code_and_stderr, RUN + ["--load", str(tmp_path), "--layernorm-epsilon", "1e-6"])
    assert code == 2 and "was saved with --layernorm-epsilon 1e-05, this run has 1e-06" in stderr


def test_a_non_finite_loss_stops_before_the_update_and_the_last_checkpoint_resumes(tmp_path):
    """--lr 1e4 explodes the weights: the loss of iteration 4 is NaN. The run stops before that update; the
    checkpoint of iteration 3 holds finite weights, and resuming from it reproduces iteration 4 exactly (the
    same stop). (Before the norm was summed in fp64 its squares overflowed fp32 at iteration 3 and the gradient
    norm stopped the run there; the gradient-norm stop itself is tested in test_exactness.py.)"""
    run = tmp_path / "run"  # the consolidated weights go beside it: never into a checkpoint directory
    # the trajectory below is the local core attention's (a CPU's `auto` is flash without attention dropout)
    argv = RUN + ["--attention-backend", "local", "--lr", "1e4", "--clip-grad", "0", "--train-iters", "30",
                  "--save", str(run), "--save-interval", "1"]
    code, stderr = _one(exit_code_and_stderr, argv)
    assert code == 1 and stderr.count("\n") == 1
    assert stderr.startswith("error: lm loss is nan at iteration 4 ") and "before the update" in stderr
    assert latest_iteration(str(run)) == 3
    tool = runpy.run_path(os.path.join(ROOT, "tools", "checkpoint_util.py"))
    tool["to_consolidated"](str(run), None, str(tmp_path / "weights.pt"))
    weights = torch.load(tmp_path / "weights.pt", weights_only=True)["model"]
    assert all(torch.isfinite(w).all() for w in weights.values())
    code, again = _one(exit_code_and_stderr, argv + ["--load", str(run)])
    assert code == 1 and again == stderr


def test_save_over_another_runs_checkpoints_is_refused_unless_asked(tmp_path):
    _one(quiet_main, RUN + ["--save", str(tmp_path), "--train-iters", "4"])
    code, stderr = _one(exit_code_and_stderr, RUN + ["--save", str(tmp_path), "--train-iters", "2"])
    assert code == 2 and stderr.count("\n") == 1
    assert f"--save {tmp_path} already holds checkpoints up to iteration 4" in stderr
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "4"
    _one(quiet_main, RUN + ["--save", str(tmp_path), "--load", str(tmp_path), "--train-iters", "5"])  # continues
    _one(quiet_main, RUN + ["--save", str(tmp_path), "--train-iters", "2", "--overwrite-checkpoints"])
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2"


def test_an_unwritable_save_directory_is_refused_at_start(tmp_path):
    (tmp_path / "file").write_text("")
    code, stderr = _one(exit_code_and_stderr, RUN + ["--save", str(tmp_path / "file" / "ckpt")])
    assert code == 2 and stderr.count("\n") == 1 and "is not a writable directory" in stderr


def test_a_successful_save_removes_partial_directories_and_keeps_only_copies(tmp_path):
    (tmp_path / "iter_0000099.tmp" / "rng").mkdir(parents=True)  # left by a save killed earlier
    (tmp_path / "iter_0000007.old").mkdir()  # without iter_0000007 beside it: the only copy, put back, never deleted
    (tmp_path / "iter_0000005.old").mkdir()
    (tmp_path / "iter_0000005").mkdir()  # beside its replacement: a leftover
    _one(quiet_main, RUN + ["--save", str(tmp_path), "--train-iters", "2", "--overwrite-checkpoints"])
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "iter_0000005", "iter_0000007",
                                            "latest_checkpointed_iteration.txt"]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 700 KiB file system: room for one TINY checkpoint (~460 KB) but not for two."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=700k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(small_tmpfs):
    save = small_tmpfs / "ckpt"
    argv = RUN + ["--save", str(save), "--save-interval", "1", "--train-iters", "5"]
    results = run_ranks(2, exit_code_and_stderr, argv)
    for code, stderr in results:
        assert code == 1 and stderr.count("\n") == 1, stderr
        assert "failed" in stderr and "the latest checkpoint (iteration 1) is intact" in stderr
    assert sorted(os.listdir(save)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    history, stdout = _one(main_capturing_stdout, RUN + ["--load", str(save), "--train-iters", "2"])
    assert "at iteration 1" in stdout and len(history["losses"]) == 1


def test_resuming_in_fp16_starts_a_fresh_loss_scaler_and_a_static_scale_is_the_flags(tmp_path):
    _one(quiet_main, RUN + ["--save", str(tmp_path / "bf16"), "--train-iters", "2", "--bf16"])
    history, stdout = _one(main_capturing_stdout, RUN + ["--load", str(tmp_path / "bf16"), "--fp16",
                                                         "--train-iters", "3", "--initial-loss-scale", "1024"])
    assert "note: the checkpoint was trained in bf16, this run trains in fp16; its fp16 loss scaler starts fresh" \
        in stdout and "loss scale: 1024.0" in stdout
    _one(quiet_main, RUN + ["--save", str(tmp_path / "fp16"), "--train-iters", "2", "--fp16",
                            "--initial-loss-scale", "4096"])
    _, stdout = _one(main_capturing_stdout, RUN + ["--load", str(tmp_path / "fp16"), "--fp16", "--train-iters", "3",
                                                   "--loss-scale", "128"])
    assert "loss scale: 128.0" in stdout


def test_resuming_with_another_global_batch_size_reads_the_right_samples(tmp_path):
    _one(quiet_main, RUN + ["--save", str(tmp_path), "--train-iters", "10", "--exit-interval", "5"])  # 40 samples
    history, stdout = _one(main_capturing_stdout, RUN + ["--load", str(tmp_path), "--train-iters", "10",
                                                         "--global-batch-size", "16"])
    assert "note: the global batch size changed from 8 (checkpoint) to 16: continuing at consumed sample 40" in stdout
    assert len(history["losses"]) == 5 and "consumed samples:          120 |" in stdout


def _dataset_with_ids_up_to(tmp_path, largest: int) -> str:
    """A real preprocessed dataset (NullTokenizer: the text is the ids) whose largest token id is `largest`."""
    rng = np.random.default_rng(0)
    docs = [" ".join(str(int(i)) for i in rng.integers(0, largest, size=40)) for _ in range(60)] + [str(largest)]
    (tmp_path / "ids.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prefix = str(tmp_path / "ids")
    assert preprocess_main(["--input", str(tmp_path / "ids.jsonl"), "--output-prefix", prefix, "--tokenizer-type",
                            "NullTokenizer", "--vocab-size", str(largest + 1), "--no-progress"]) == 0
    return prefix + "_text_document"


@pytest.mark.parametrize("tp", [1, 2])
def test_token_ids_beyond_the_vocabulary_are_refused_at_dataset_open(tmp_path, tp):
    """Tokenized with ids up to 499, trained with a vocabulary of 300 (NullTokenizer --vocab-size 299 + EOD):
    one line naming the dataset, the largest id and the vocabulary, on every TP size (TP 2 trained on)."""
    prefix = _dataset_with_ids_up_to(tmp_path, 499)
    os.remove(prefix + ".tokenizer.json")  # as Megatron's preprocessing leaves it: only the ids can tell
    argv = [a for a in RUN if a not in ("--mock-data",)]
    argv[argv.index("--vocab-size") + 1] = "299"
    argv += ["--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--split", "1,0,0",
             "--tensor-model-parallel-size", str(tp)]
    for code, stderr in run_ranks(tp, exit_code_and_stderr, argv):
        assert code == 2 and stderr.count("\n") == 1, stderr
        assert stderr.startswith("error: ") and prefix in stderr and "499" in stderr and "300" in stderr, stderr


def _sigterm_during(argv, delay):
    threading.Timer(delay, os.kill, (os.getpid(), signal.SIGTERM)).start()
    return main_capturing_stdout(argv)


def test_sigterm_saves_and_leaves_without_the_end_of_training_evaluation(tmp_path):
    argv = TINY + ["--train-iters", "100000", "--eval-interval", "100000", "--eval-iters", "2",
                   "--save", str(tmp_path)]
    history, stdout = _one(_sigterm_during, argv, 1.0)
    assert "stopped by SIGTERM at iteration" in stdout and "skipping the end-of-training evaluation" in stdout
    assert history["valid_losses"] == [] and "test_loss" not in history
    assert f"saved checkpoint at iteration {len(history['losses'])}" in stdout
