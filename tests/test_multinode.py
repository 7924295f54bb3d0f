"""Two torchrun agents on this machine as two nodes (`--nnodes 2`, c10d rendezvous on localhost, 2 processes
each, TP 2 x DP 2): the layout, the losses against one process, checkpoints moving between 2-node and 1-node
jobs, a --save that is not shared, and a lost node. Each agent is its own process tree, as on two machines."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.cli import LINE, ROOT, TINY, assert_close_lists

pytestmark = pytest.mark.slow  # torchrun jobs, 5-10 s each on 2 cores

TP2 = ["--tensor-model-parallel-size", "2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(tmp_path):  # TMPDIR: torchrun's agents keep their log folders there
    return {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path), "PYTHONPATH": ROOT}


def _agents(tmp_path, argvs, name, cwds=None):
    """Start one torchrun agent per argv (its node's own pretrain_gpt.py flags), in `cwds[node]` (default the
    repository); returns the Popen objects, each writing tmp_path/{name}{node}.out/.err."""
    endpoint = f"localhost:{_free_port()}"
    procs = []
    for node, argv in enumerate(argvs):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", name,
               os.path.join(ROOT, "pretrain_gpt.py")] + argv
        out, err = (open(tmp_path / f"{name}{node}.{kind}", "w") for kind in ("out", "err"))
        procs.append(subprocess.Popen(cmd, cwd=cwds[node] if cwds else ROOT, stdout=out, stderr=err, env=_env(tmp_path),
                                      start_new_session=True))
    return procs


def _outputs(tmp_path, name):
    return [((tmp_path / f"{name}{n}.out").read_text(), (tmp_path / f"{name}{n}.err").read_text()) for n in (0, 1)]


def two_nodes(tmp_path, argv, name, argvs=None, cwds=None):
    """(exit codes, [(stdout, stderr) per agent]) of a 2-node job; every agent gets `argv` unless `argvs`."""
    procs = _agents(tmp_path, argvs or [argv, argv], name, cwds)
    codes = [p.wait(timeout=240) for p in procs]
    return codes, _outputs(tmp_path, name)


def one_node(tmp_path, argv, processes=4):
    cmd = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
                              if processes > 1 else []) + ["pretrain_gpt.py"] + argv
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, env=_env(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def losses(stdout):
    return [float(m.group(4)) for m in map(LINE.match, stdout.splitlines()) if m]


HALF, WHOLE = TINY + ["--train-iters", "5"], TINY + ["--train-iters", "10"]


def _two_nodes_against_one_process(tmp_path):
    """The first five iterations on one process (saved to s) and on two nodes at TP 2 x DP 2 (saved to a)."""
    single_first = losses(one_node(tmp_path, HALF + ["--save", str(tmp_path / "s")], processes=1))

    codes, outs = two_nodes(tmp_path, TP2 + HALF + ["--save", str(tmp_path / "a")], "fresh")
    assert codes == [0, 0], outs
    logging = [out for out, _ in outs if "lm loss" in out]
    assert len(logging) == 1, "only global rank 0 (on whichever node joined first) prints"
    # torchrun numbers ranks node by node: TP pairs (0,1), (2,3) each on one node, DP pairs (0,2), (1,3) across
    assert "nodes: 2 (2 processes each) | TP groups inside a node | DP groups across 2 node(s)" in logging[0]
    assert_close_lists(losses(logging[0]), single_first)


def test_two_nodes_match_one_process(tmp_path):
    _two_nodes_against_one_process(tmp_path)


@pytest.mark.product  # three more jobs after the two above; make test keeps the 2-node run against one process
def test_checkpoints_move_between_node_counts(tmp_path):
    _two_nodes_against_one_process(tmp_path)
    # a 1-process checkpoint resumed by the 2-node job, and the 2-node checkpoint by a 1-node torchrun job
    codes, outs = two_nodes(tmp_path, TP2 + WHOLE + ["--load", str(tmp_path / "s"), "--save", str(tmp_path / "b")],
                            "resume")
    assert codes == [0, 0], outs
    two_node_resumed = losses("".join(out for out, _ in outs))
    one_node_resumed = losses(one_node(tmp_path, TP2 + WHOLE + ["--load", str(tmp_path / "a"),
                                                                "--save", str(tmp_path / "c")]))
    single_resumed = losses(one_node(tmp_path, WHOLE + ["--load", str(tmp_path / "s"), "--save", str(tmp_path / "s")],
                                     processes=1))
    assert len(single_resumed) == 5
    assert_close_lists(two_node_resumed, single_resumed)
    assert_close_lists(one_node_resumed, single_resumed)


def test_a_save_directory_not_shared_by_the_nodes_is_refused_at_start(tmp_path):
    # each agent its own --save, as node-local disks would be: the ranks of one node do not see rank 0's file
    argvs = [TP2 + TINY + ["--save", str(tmp_path / f"local{node}")] for node in (0, 1)]
    codes, outs = two_nodes(tmp_path, None, "unshared", argvs)
    assert all(code != 0 for code in codes)
    # one line per rank, each naming its own --save; torchrun's agent stops a node's other workers once one has
    # failed, so a rank may be gone before it says its line: at least one per node
    per_node = [[line for line in err.splitlines() if line.startswith("error: ")] for _, err in outs]
    assert all(1 <= len(lines) <= 2 for lines in per_node), outs
    errors = per_node[0] + per_node[1]
    for line in errors:
        assert re.search(r"--save \S+local[01] is not one directory for every rank: rank [23] \(node \S+/1\) "
                         r"does not see", line), line
    assert not any("lm loss" in out for out, _ in outs), "refused before training"


def test_a_load_path_that_only_one_node_has_is_one_line_on_every_rank_within_seconds(tmp_path):
    """--load ckpt, relative: the first node's working directory holds a checkpoint, the second's nothing (as a copy
    on one machine only): one line per rank naming --load and what each side sees, not the distributed timeout."""
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir()
    one_node(tmp_path, TINY + ["--train-iters", "2", "--save", str(tmp_path / "node0" / "ckpt")], processes=1)
    start = time.monotonic()
    codes, outs = two_nodes(tmp_path, TP2 + TINY + ["--load", "ckpt"], "load", cwds=[tmp_path / "node0",
                                                                                      tmp_path / "node1"])
    assert all(code != 0 for code in codes) and time.monotonic() - start < 90, outs
    per_node = [[line for line in err.splitlines() if line.startswith("error: ")] for _, err in outs]
    assert all(1 <= len(lines) <= 2 for lines in per_node), outs  # a rank may be stopped by its agent first
    for line in per_node[0] + per_node[1]:  # which node joined first (ranks 0-1) is the rendezvous' choice
        assert re.fullmatch(r"error: --load ckpt is not the same for every rank: ranks (0-1|2-3) sees? checkpoints "
                            r"up to iteration 2; ranks (0-1|2-3) sees? no such path\. .*", line), line
    assert not any("lm loss" in out for out, _ in outs), "refused before training"


def _descendants(pid):
    """The process tree under `pid` (torchrun starts each worker in its own session: killing the agent's
    process group would leave them running, so a lost node is every process of the tree killed)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        found += children.get(todo[-1], [])
        todo = todo[:-1] + children.get(todo[-1], [])
    return found


def test_a_lost_node_ends_the_other_with_one_line_per_rank(tmp_path):
    argv = TP2 + TINY + ["--train-iters", "100000", "--log-interval", "10", "--eval-interval", "100000",
                         "--distributed-timeout-minutes", "1"]
    procs = _agents(tmp_path, [argv, argv], "lost")
    try:
        deadline = time.monotonic() + 120
        while "lm loss" not in "".join(out for out, _ in _outputs(tmp_path, "lost")):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), _outputs(tmp_path, "lost")
            time.sleep(0.5)
        lost, survivor = procs[1], procs[0]
        for pid in [lost.pid] + _descendants(lost.pid):
            os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        code = survivor.wait(timeout=120)
        waited = time.monotonic() - start
    finally:
        for p in procs:
            if p.poll() is None:
                for pid in [p.pid] + _descendants(p.pid):
                    os.kill(pid, signal.SIGKILL)
                p.wait()
    assert code != 0
    assert waited < 60, f"the surviving node took {waited:.0f} s to stop (--distributed-timeout-minutes 1)"
    err = _outputs(tmp_path, "lost")[0][1]
    workers = [line for line in err.splitlines() if line.startswith("error: ")]
    # each surviving rank says one line, with no traceback (one may be stopped by its agent before it does)
    assert 1 <= len(workers) <= 2, err[-3000:]
    assert all("a peer rank has died or timed out" in line for line in workers), workers
    # no frame of mpzero's in a traceback: what follows the workers' lines is torchrun's own report of them (which
    # may name the checkout, as the venv's python: a clone in a folder named mpzero is .../mpzero/.venv/bin/python)
    frames = re.findall(r'File "([^"]+)", line \d+', err)
    ours = [f for f in frames if f.startswith(os.path.join(ROOT, "mpzero") + os.sep) or f.endswith("pretrain_gpt.py")]
    assert not ours, err[-3000:]
