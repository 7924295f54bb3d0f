"""tools/preprocess_data.py stopped by a real SIGTERM: temporary files removed, one `error:` line, exit
143; and temporary files a SIGKILL leaves behind are removed by the next run of the same prefix."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mpzero.data import IndexedDataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "preprocess_data.py")


def _start(tmp_path, workers, new_session=False):
    """A run kept busy for minutes: one 1 MB input given 400 times."""
    inp = tmp_path / "in.jsonl"
    line = json.dumps({"text": " ".join(str(i % 1000) for i in range(300))}) + "\n"
    inp.write_text(line * (1_000_000 // len(line)))
    cmd = [sys.executable, TOOL, "--input", *[str(inp)] * 400, "--output-prefix", str(tmp_path / "out"),
           "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--no-progress", "--workers", str(workers)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=new_session)
    deadline = time.monotonic() + 120
    while not _temporaries(tmp_path) or os.path.getsize(tmp_path / _temporaries(tmp_path)[0]) == 0:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    return proc


def _temporaries(tmp_path):
    return sorted(f for f in os.listdir(tmp_path) if ".tmp" in f)


@pytest.mark.parametrize("workers, whole_group", [(1, False), (2, False), (2, True)])
def test_sigterm_removes_temporaries_and_says_one_line(tmp_path, workers, whole_group):
    proc = _start(tmp_path, workers, new_session=whole_group)
    if whole_group:  # as a batch scheduler or `timeout` does: the workers get it too
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert err.splitlines() == [f"error: interrupted by SIGTERM: nothing written to {tmp_path / 'out'}_*_document "
                                f"and its temporary files removed; run the same command again"], err
    assert os.listdir(tmp_path) == ["in.jsonl"]


def test_temporaries_of_a_killed_run_are_removed_by_the_next_run_of_that_prefix(tmp_path):
    proc = _start(tmp_path, 2)
    proc.kill()  # SIGKILL: no handler runs, the temporary .bin stays
    proc.communicate(timeout=60)  # returns once the workers, holding its pipes, have died with it
    left = _temporaries(tmp_path)
    assert left and all(f.startswith("out_text_document.bin.tmp") for f in left)
    # A temporary of a live process (another run writing the same prefix) must be left alone.
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as alive:
        live = left[0].replace(str(proc.pid), str(alive.pid))
        (tmp_path / live).write_bytes(b"")
        (tmp_path / "in.jsonl").write_text(json.dumps({"text": "1 2 3"}) + "\n")
        result = subprocess.run([sys.executable, TOOL, "--input", str(tmp_path / "in.jsonl"), "--output-prefix",
                                 str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer", "--vocab-size", "10",
                                 "--no-progress"], capture_output=True, text=True, cwd=ROOT)
        assert result.returncode == 0, result.stderr
        assert _temporaries(tmp_path) == [live]
        alive.kill()
    assert IndexedDataset(str(tmp_path / "out_text_document"))[0].tolist() == [1, 2, 3]
