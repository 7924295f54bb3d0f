"""mpzero/comm.py: a run that compiles nothing never loads torch's compiler (issue 47: `torch.compiler.disable`
applied at import loaded it into every process), and under torch.compile a collective still runs eagerly, a
graph break around it, without recompiling as its byte counter moves."""

import os
import subprocess
import sys

import torch
import torch.distributed as dist

from mpzero.comm import CommGroup
from tests.distributed import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_LIBRARY = "import mpzero, mpzero.comm, mpzero.parallel, mpzero.zero, mpzero.models, mpzero.training"
_PLAIN_RUN = ("import contextlib, io, pretrain_gpt\nfrom tests.cli import TINY\n"
              "with contextlib.redirect_stdout(io.StringIO()):\n"
              "    pretrain_gpt.main(TINY + ['--train-iters', '1', '--eval-iters', '0'])")


def _compiler_loaded_after(code: str) -> bool:
    probe = code + "\nimport sys\nprint('torch._dynamo' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1] == "True"


def test_importing_mpzero_does_not_load_the_compiler():
    assert not _compiler_loaded_after(_LIBRARY)


def test_a_plain_run_does_not_load_the_compiler():
    assert not _compiler_loaded_after(_PLAIN_RUN)


def _compiled_around_a_collective() -> tuple[list[list[str]], int, bool]:
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append([str(node.target) for node in graph_module.graph.nodes if node.op == "call_function"])
        return graph_module.forward

    group = CommGroup(dist.group.WORLD, (0, 1), dist.get_rank())
    linear = torch.nn.Linear(4, 4)

    def forward(x):
        y = linear(x) * 2
        group.all_reduce(y)
        return y.relu() + 1

    compiled = torch.compile(forward, backend=recording_backend)
    x = torch.ones(3, 4) * (dist.get_rank() + 1)
    same = all(torch.equal(compiled(x), forward(x)) for _ in range(4))
    return graphs, group.stats.calls["all_reduce"], same


def test_a_collective_runs_eagerly_between_compiled_graphs():
    for graphs, calls, same in run_ranks(2, _compiled_around_a_collective, deadline=300):
        assert same and calls == 8  # every call counted, compiled or not
        assert len(graphs) == 2  # the pieces before and after the collective, compiled once each
        assert not any("all_reduce" in target for graph in graphs for target in graph)
