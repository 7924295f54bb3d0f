"""Megatron's --profile with --use-pytorch-profiler on the CPU (mpzero/training/profiling.py): the profiled ranks write
one torch.profiler trace each into --tensorboard-dir, of iterations (--profile-step-start, --profile-step-end] in
the log's numbering, and nothing else changes; a run that stops inside the window or resumes past it writes no
trace and says so, and no temporary file stays; a trace that cannot be written is one warning and the run goes on;
every inconsistent combination is one line at start. Nsight
Systems' mode (no --use-pytorch-profiler) needs CUDA: refused here, run on a GPU by tests/gpu/test_mixed_precision.py.
"""

import json
import os

import pytest

from tests.cli import TINY, exit_code_and_stderr, main_capturing_stdout
from tests.distributed import run_ranks

PYTORCH = ["--profile", "--use-pytorch-profiler", "--profile-step-start", "1", "--profile-step-end", "3"]


def _profiler_steps(path: str) -> list[str]:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    assert any(event.get("name") == "aten::mm" for event in events), "the ops of the traced iterations"
    return sorted({event["name"] for event in events if event.get("name", "").startswith("ProfilerStep#")})


def test_the_trace_holds_the_window_and_changes_nothing_computed(tmp_path):
    plain = run_ranks(1, main_capturing_stdout, TINY)[0][0]
    history, stdout = run_ranks(1, main_capturing_stdout, TINY + PYTORCH + ["--tensorboard-dir", str(tmp_path)])[0]
    assert history["losses"] == plain["losses"] and history["grad_norms"] == plain["grad_norms"]
    path = tmp_path / "rank0.iterations-2-3.pt.trace.json"
    assert f"profile: rank 0 traced iterations 2-3 into {path}" in stdout.splitlines()
    assert _profiler_steps(str(path)) == ["ProfilerStep#1", "ProfilerStep#2"]  # torch's numbers: 1 is iteration 2
    assert _traces(tmp_path) == [path.name]


def test_only_the_named_ranks_trace(tmp_path):
    outs = run_ranks(2, main_capturing_stdout, TINY + PYTORCH + ["--tensorboard-dir", str(tmp_path),
                                                                "--profile-ranks", "1"])
    assert [line for _, out in outs for line in out.splitlines() if line.startswith("profile: ")] == [
        f"profile: rank 1 traced iterations 2-3 into {tmp_path / 'rank1.iterations-2-3.pt.trace.json'}"]
    assert [p for p in os.listdir(tmp_path) if p.endswith(".json")] == ["rank1.iterations-2-3.pt.trace.json"]


def test_from_iteration_zero_there_is_no_warm_up_step(tmp_path):
    argv = TINY + ["--profile", "--use-pytorch-profiler", "--profile-step-start", "0", "--profile-step-end", "2",
                   "--tensorboard-dir", str(tmp_path)]
    run_ranks(1, main_capturing_stdout, argv)
    assert _profiler_steps(str(tmp_path / "rank0.iterations-1-2.pt.trace.json")) == ["ProfilerStep#0",
                                                                                   "ProfilerStep#1"]


def _traces(folder) -> list[str]:
    return sorted(p for p in os.listdir(folder) if not p.startswith("events.out.tfevents"))


@pytest.mark.parametrize("exit_interval", [1, 2], ids=["in the warm-up", "after the first traced iteration"])
def test_a_run_stopped_inside_the_window_writes_no_trace_and_says_so(tmp_path, exit_interval):
    argv = TINY + PYTORCH + ["--tensorboard-dir", str(tmp_path), "--exit-interval", str(exit_interval)]
    _, stdout = run_ranks(1, main_capturing_stdout, argv)[0]
    assert (f"profile: rank 0 wrote no trace: the run stopped after iteration {exit_interval}, before the end of the "
            f"window 2-3") in stdout.splitlines()
    assert _traces(tmp_path) == []


def test_a_run_resumed_past_the_window_traces_nothing(tmp_path):
    save, traces = str(tmp_path / "save"), tmp_path / "tb"
    run_ranks(1, main_capturing_stdout, TINY + ["--save", save, "--exit-interval", "2"])
    _, stdout = run_ranks(1, main_capturing_stdout, TINY + ["--profile", "--use-pytorch-profiler",
                                                            "--profile-step-start", "0", "--profile-step-end", "1",
                                                            "--tensorboard-dir", str(traces), "--load", save])[0]
    assert "note: rank 0 traces nothing: this run starts after iteration 2, past --profile-step-end 1" in stdout
    assert _traces(traces) == [] and "profile: " not in stdout


def test_a_trace_that_cannot_be_written_is_one_warning_and_the_run_goes_on(tmp_path):
    """A directory at the trace's name (as a full disk would, the move into place fails): one warning, the same
    losses as without the profiler, no temporary file or private directory left."""
    plain = run_ranks(1, main_capturing_stdout, TINY)[0][0]
    (tmp_path / "rank0.iterations-2-3.pt.trace.json").mkdir()
    history, stdout = run_ranks(1, main_capturing_stdout, TINY + PYTORCH + ["--tensorboard-dir", str(tmp_path)])[0]
    assert history["losses"] == plain["losses"] and len(history["losses"]) == 10
    warnings = [line for line in stdout.splitlines() if line.startswith("warning: rank 0 could not write its trace")]
    assert len(warnings) == 1 and warnings[0].endswith("training goes on without it"), stdout
    assert _traces(tmp_path) == ["rank0.iterations-2-3.pt.trace.json"]  # the directory, as it was
    assert os.listdir(tmp_path / "rank0.iterations-2-3.pt.trace.json") == []


WINDOW = ["--profile-step-start", "0", "--profile-step-end", "2"]


@pytest.mark.parametrize("flags, message", [
    (["--use-pytorch-profiler"], "--use-pytorch-profiler shapes --profile's trace, but --profile is not given: add "
                                 "--profile or drop it"),
    (["--profile-ranks", "0"], "--profile-ranks shapes --profile's trace"),
    (["--profile", "--use-pytorch-profiler"] + WINDOW, "--use-pytorch-profiler writes its traces into "
                                                       "--tensorboard-dir: give one"),
    (["--profile", "--profile-step-start", "3", "--profile-step-end", "3"],
     "--profile-step-end 3 is not after --profile-step-start 3"),
    (["--profile"], "--profile-step-end 12 is past --train-iters 10"),  # Megatron's default window: 11 and 12
    (["--profile", "--profile-ranks", "0", "1"] + WINDOW,
     "--profile-ranks 1 is not a rank of this 1-process run (ranks 0-0)"),
    (["--profile"] + WINDOW, "--profile without --use-pytorch-profiler marks the window for Nsight Systems through "
                             "the CUDA profiler API, and this run computes on the cpu: add --use-pytorch-profiler "
                             "(and --tensorboard-dir)"),
    (["--profile-ranks", "-1"], "--profile-ranks")])
def test_inconsistent_profile_flags_are_one_line_at_start(flags, message):
    code, err = exit_code_and_stderr(TINY + flags)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
