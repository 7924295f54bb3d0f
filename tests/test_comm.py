"""mpzero/comm.py's point-to-point and all-to-all on forked gloo ranks: what arrives, and the bytes counted (what
each rank sends). The collectives of ZeRO and TP are held by tests/test_parallel.py and the layout tests.
A run that compiles nothing never loads torch's compiler (issue 47: `torch.compiler.disable` applied at import
loaded it into every process), and under torch.compile a collective still runs eagerly, a graph break around it,
without recompiling as its byte counter moves."""

import os
import subprocess
import sys

import pytest
import torch

from mpzero.parallel import init_parallel
from tests.distributed import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_LIBRARY = "import mpzero, mpzero.comm, mpzero.parallel, mpzero.zero, mpzero.models, mpzero.training"
_PLAIN_RUN = ("import contextlib, io, pretrain_gpt\nfrom tests.cli import TINY\n"
              "with contextlib.redirect_stdout(io.StringIO()):\n"
              "    pretrain_gpt.main(TINY + ['--train-iters', '1', '--eval-iters', '0'])")

_ZERO_BUBBLE_BACKWARD = (  # the deferring linear of an uncompiled --enable-zero-bubble run: its I and W passes
    "import torch\nfrom mpzero.tensor_parallel.weight_grad import WeightGradStore, deferring_linear\n"
    "store, x, w = WeightGradStore(), torch.ones(2, 4, requires_grad=True), torch.ones(3, 4, requires_grad=True)\n"
    "with store.defer(0):\n    deferring_linear(x, w, None, store).sum().backward()\nstore.run(0)\n"
    "assert w.grad is not None")


def _ring_exchange():
    """Each rank sends its vector to the next and receives the previous one's, both posted at once."""
    world = init_parallel(1).world
    nxt, prev = (world.rank + 1) % world.size, (world.rank - 1) % world.size
    mine, theirs = torch.full((3,), float(world.rank)), torch.empty(3)
    world.exchange(sends=[(mine, nxt)], recvs=[(theirs, prev)])
    return theirs.tolist(), dict(world.stats.bytes), dict(world.stats.calls)


def test_exchange_delivers_and_counts_the_bytes_sent():
    results = run_ranks(3, _ring_exchange)
    assert [r[0] for r in results] == [[2.0] * 3, [0.0] * 3, [1.0] * 3]
    assert all(r[1] == {"send": 12.0} and r[2] == {"send": 1} for r in results)


def _uneven_all_to_all():
    """Rank r sends r + 1 rows to every peer (one row of 2 floats each); ranks receive 1, 2, 3 rows from 0, 1, 2."""
    world = init_parallel(1).world
    r, n = world.rank, world.size
    sent = torch.full((n * (r + 1), 2), float(r))
    received = torch.empty(sum(q + 1 for q in range(n)), 2)
    world.all_to_all_single(received, sent, [q + 1 for q in range(n)], [r + 1] * n)
    return received[:, 0].tolist(), world.stats.bytes["all_to_all"]


def test_all_to_all_with_uneven_splits_counts_what_leaves_the_rank():
    results = run_ranks(3, _uneven_all_to_all)
    assert all(r[0] == [0.0, 1.0, 1.0, 2.0, 2.0, 2.0] for r in results)
    # rank r keeps r + 1 rows of 8 bytes and sends 2 (r + 1)
    assert [r[1] for r in results] == [16.0, 32.0, 48.0]


def _send_a_view():
    world = init_parallel(1).world
    with pytest.raises(ValueError, match="not contiguous"):
        world.exchange(sends=[(torch.zeros(4, 4).t(), 1 - world.rank)])
    return dict(world.stats.bytes)


def test_a_view_handed_to_a_collective_is_refused():
    assert run_ranks(2, _send_a_view) == [{}, {}]

def _compiler_loaded_after(code: str) -> bool:
    probe = code + "\nimport sys\nprint('torch._dynamo' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1] == "True"


def test_importing_mpzero_does_not_load_the_compiler():
    assert not _compiler_loaded_after(_LIBRARY)


def test_a_plain_run_does_not_load_the_compiler():
    assert not _compiler_loaded_after(_PLAIN_RUN)


def test_zero_bubbles_split_backward_does_not_load_the_compiler():
    assert not _compiler_loaded_after(_ZERO_BUBBLE_BACKWARD)


def _compiled_around_a_collective() -> tuple[list[list[str]], int, bool]:
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append([str(node.target) for node in graph_module.graph.nodes if node.op == "call_function"])
        return graph_module.forward

    group = init_parallel(1).world
    linear, peer = torch.nn.Linear(4, 4), 1 - group.rank

    def forward(x):
        y = linear(x) * 2
        group.all_reduce(y)
        theirs = torch.empty_like(y)
        group.exchange(sends=[(y, peer)], recvs=[(theirs, peer)])
        return (y - theirs).relu() + 1

    compiled = torch.compile(forward, backend=recording_backend)
    x = torch.ones(3, 4) * (group.rank + 1)
    same = all(torch.equal(compiled(x), forward(x)) for _ in range(4))
    return graphs, dict(group.stats.calls), same


def test_collectives_run_eagerly_between_compiled_graphs():
    for graphs, calls, same in run_ranks(2, _compiled_around_a_collective, deadline=300):
        assert same and calls == {"all_reduce": 8, "send": 8}  # every call counted, compiled or not
        assert len(graphs) == 3  # the pieces around the two collectives, compiled once each
        assert not any(word in target for graph in graphs for target in graph for word in ("reduce", "send"))
