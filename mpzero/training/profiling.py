"""Megatron's --profile: a trace of iterations (--profile-step-start, --profile-step-end] on the ranks --profile-ranks
names (`IterationProfiler`).

With --use-pytorch-profiler, torch.profiler records them (the host's ops and, on a GPU, the CUDA kernels, with
shapes and Python stacks, as Megatron records them) and each profiled rank writes one trace into --tensorboard-dir,
`rank{N}.iterations-{first}-{last}.pt.trace.json` (TensorBoard's profiler plugin, Perfetto and chrome://tracing read
it), exported into a private directory first and moved into place (a trace that cannot be written is a warning:
the run goes on). Without it the window is marked for NVIDIA Nsight Systems, as Megatron does: the CUDA profiler
API starts and stops the capture around it and NVTX ranges name every op (run under
`nsys profile --capture-range=cudaProfilerApi`); that needs CUDA.

Iterations are numbered as the log numbers them: start 10 and end 12 trace iterations 11 and 12 (torch.profiler
labels them ProfilerStep#1 and #2). torch.profiler starts one iteration earlier, as its warm-up, so its own
start-up stays out of the trace. A resumed run traces what is left of the window after its first iteration. A run
that stops inside the window (--exit-interval, SIGTERM, an error) writes no torch.profiler trace (its last step
would hold whatever ran after the last iteration: a checkpoint's save, the error) and says so.
"""

from __future__ import annotations

import os
import shutil

import torch

from mpzero.errors import shorten
from mpzero.files import private_directory, publish_file
from mpzero.training.config import ProfileConfig


class IterationProfiler:
    """The loop calls `before` and `after` each iteration with the number of iterations done, and `close` when it
    ends; ranks not in --profile-ranks (and runs without --profile) do nothing. A profiled rank prints its own lines
    (what it traced, where), not through rank 0."""

    def __init__(self, config: ProfileConfig, rank: int, tensorboard_dir: str | None, cuda: bool):
        self.config, self.rank, self.directory, self.cuda = config, rank, tensorboard_dir, cuda
        self.on = config.enabled and rank in config.ranks
        self._torch: torch.profiler.profile | None = None
        self._nvtx = None
        self._first = self._last = 0  # the first iteration traced, and the last one run since the profiler started
        self._written: str | None = None  # the trace's path, once torch.profiler's schedule wrote it
        self._discard = False  # the run stopped inside the window: torch.profiler's stop writes nothing

    def note_resumed(self, completed: int) -> None:
        """Says so when a run resuming after iteration `completed` finds the window behind it."""
        if self.on and completed >= self.config.step_end:
            print(f"note: rank {self.rank} traces nothing: this run starts after iteration {completed}, past "
                  f"--profile-step-end {self.config.step_end}", flush=True)

    def before(self, completed: int) -> None:
        """Called with the number of iterations done, before the next one runs."""
        start, end = self.config.step_start, self.config.step_end
        if not self.on or completed >= end:
            return
        if self.config.use_pytorch_profiler:
            if self._torch is None and completed >= start - 1:
                self._start_torch(completed)
        elif self._nvtx is None and completed >= start:
            self._first = completed + 1
            torch.cuda.profiler.start()
            self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self._nvtx.__enter__()

    def after(self, completed: int) -> None:
        """Called with the number of iterations done, after one ran: at the window's end, stops and says what was
        traced."""
        if self._torch is None and self._nvtx is None:
            return
        self._last = completed
        if self._torch is not None:
            self._torch.step()  # after the window's last iteration its schedule writes the trace
        if completed == self.config.step_end:
            self._stop()

    def close(self) -> None:
        """The run ended inside the window: the capture stops, and the rank says what became of it."""
        if self._torch is not None:
            self._discard = True
            self._torch.stop()
            self._torch = None
            print(f"profile: rank {self.rank} wrote no trace: the run stopped after iteration {self._last}, before "
                  f"the end of the window {self._first}-{self.config.step_end}", flush=True)
        elif self._nvtx is not None:
            self._stop()

    def _start_torch(self, completed: int) -> None:
        warmup = 1 if completed < self.config.step_start else 0
        self._first = completed + 1 + warmup
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                              if self.cuda else [])
        schedule = torch.profiler.schedule(wait=0, warmup=warmup, active=self.config.step_end - self._first + 1,
                                           repeat=1)
        self._torch = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=self._write,
                                             record_shapes=True, with_stack=True)
        self._torch.start()

    def _write(self, profiler: torch.profiler.profile) -> None:
        """The trace, exported into a private directory made for it (torch's exporter opens names of its own beside
        the file, and follows a link planted at one), then moved into place. A trace that cannot be written (a
        directory at its name, a full disk) is one warning: the run goes on without it."""
        if self._discard:
            return
        path = os.path.join(self.directory, f"rank{self.rank}.iterations-{self._first}-{self._last}.pt.trace.json")
        private = None
        try:
            private = private_directory(self.directory, f"rank{self.rank}.profile")
            inside = os.path.join(private, os.path.basename(path))
            profiler.export_chrome_trace(inside)
            publish_file(inside, path)
            self._written = path
        except (OSError, RuntimeError) as error:  # torch's exporter reports a failed write as a RuntimeError
            reason = error.strerror if isinstance(error, OSError) and error.strerror else shorten(str(error))
            print(f"warning: rank {self.rank} could not write its trace {path} ({reason}); training goes on without it",
                  flush=True)
        finally:
            if private is not None:
                shutil.rmtree(private, ignore_errors=True)

    def _stop(self) -> None:
        """Stops the capture at the window's end (torch.profiler's schedule wrote the trace at its last step) and
        says what was traced."""
        if self._torch is not None:
            self._torch.stop()
            self._torch = None
            where = f"into {self._written}" if self._written else "(no trace written: see the warning)"
        else:
            self._nvtx.__exit__(None, None, None)
            self._nvtx = None
            torch.cuda.profiler.stop()
            where = "for Nsight Systems (the CUDA profiler API's capture range)"
        print(f"profile: rank {self.rank} traced iterations {self._first}-{self._last} {where}", flush=True)
