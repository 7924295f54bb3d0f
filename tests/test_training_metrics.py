"""The run's scalars to TensorBoard and Weights & Biases (mpzero/training/metrics.py): wandb runs offline
(WANDB_MODE=offline, nothing leaves the machine) and its logged history is read back from the run directory."""

import os
import sys
import tempfile

import pytest

from tests.cli import TINY, exit_code_and_stderr, quiet_main
from tests.distributed import run_ranks
from tests.wandb_offline import offline_run


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing written outside tmp_path
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    # wandb's import makes temporary folders that only its atexit hook removes (after the suite's check of the
    # temp folder; never in a forked rank)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    pytest.importorskip("wandb")  # in the test extra: skipped only outside `make test`


def test_wandb_logs_the_tensorboard_scalars_and_the_flags(tmp_path, offline_wandb):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    argv = TINY + ["--tensorboard-dir", str(tmp_path / "tb"), "--wandb-project", "mpzero-test",
                   "--wandb-exp-name", "tiny", "--save", str(tmp_path / "ckpt"), "--zero-stage", "2"]
    history = run_ranks(2, quiet_main, argv)[0]
    # --wandb-save-dir's default is --save, where wandb makes its own wandb/ folder (not --save/wandb/wandb/)
    assert os.listdir(tmp_path / "ckpt" / "wandb") and not os.path.exists(tmp_path / "ckpt" / "wandb" / "wandb")
    run = offline_run(str(tmp_path / "ckpt"))
    assert (run["project"], run["name"]) == ("mpzero-test", "tiny")
    assert run["config"]["num_layers"] == 2 and run["config"]["zero_stage"] == 2
    assert run["config"]["global_batch_size"] == 8, "the resolved flags, as saved with checkpoints"

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tensorboard = {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    wandb = {(tag, row["_step"]): value for row in run["history"] for tag, value in row.items()
             if not tag.startswith("_")}
    assert set(wandb) == set(tensorboard), set(wandb) ^ set(tensorboard)
    for key, value in wandb.items():  # TensorBoard stores float32
        assert tensorboard[key] == pytest.approx(value, rel=1e-6, abs=1e-30), key
    tags = {tag for tag, _ in wandb}
    assert {"lm loss", "learning-rate", "grad-norm", "loss-scale", "throughput", "lm loss validation",
            "zero/comm-bytes-per-iter", "zero/comm-theory-bytes-per-iter", "zero/memory-bytes",
            "zero/memory-formula-bytes", "mem-max-bytes/rank-1", "activations/rank-1-layers-bytes"} <= tags
    assert [wandb[("lm loss", step)] for step in range(1, 11)] == pytest.approx(history["losses"], rel=1e-12)
    assert wandb[("zero/comm-bytes-per-iter", 10)] == pytest.approx(wandb[("zero/comm-theory-bytes-per-iter", 10)],
                                                                    rel=1e-3)


def _without_wandb(argv):
    sys.modules["wandb"] = None  # `import wandb` raises ImportError, as when it is not installed
    return exit_code_and_stderr(argv)


@pytest.mark.parametrize("flags, message", [
    (["--wandb-project", "p"], "--wandb-project needs the wandb package, which is not installed: "
                               "pip install -e '.[wandb]'"),
    (["--wandb-exp-name", "x"], "--wandb-exp-name needs --wandb-project"),
    (["--wandb-entity", "me", "--wandb-save-dir", "wb"], "--wandb-save-dir needs --wandb-project"),
    (["--wandb-project", " "], "--wandb-project is empty"),
])
def test_wandb_flags_are_one_line_at_start(flags, message):
    code, stderr = run_ranks(1, _without_wandb, TINY + flags)[0]
    assert code == 2 and stderr.count("\n") == 1 and stderr.startswith("error: ") and message in stderr, stderr


def test_a_wandb_save_dir_that_is_a_file_is_refused(tmp_path, offline_wandb):
    (tmp_path / "file").write_text("")
    code, stderr = run_ranks(1, exit_code_and_stderr, TINY + ["--wandb-project", "p", "--wandb-save-dir",
                                                              str(tmp_path / "file")])[0]
    assert code == 2 and stderr.count("\n") == 1
    assert f"--wandb-save-dir {tmp_path / 'file'} is not a writable directory" in stderr
