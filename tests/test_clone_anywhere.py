"""The suite passes wherever the clone lives and whatever else runs on the machine: its temp files go to a private
folder (tests/conftest.py), and no test depends on the checkout's path. Proven by running tests from a copy in a
folder named `mpzero` (the default clone's name, its venv at mpzero/.venv) while another process keeps writing into
the system's temp folder."""

import glob
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.conftest import SYSTEM_TEMP, TEST_TEMP
from tests.cli import ROOT

# the path-sensitive case (torchrun's report names the venv's python) and this file's own temp-folder check
NESTED = ["tests/test_clone_anywhere.py::test_the_run_and_its_subprocesses_have_a_private_temp_folder",
          "tests/test_multinode.py::test_a_lost_node_ends_the_other_with_one_line_per_rank"]
WRITER = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
made = []
try:
    while True:
        made.append(os.path.join(sys.argv[1], f"{sys.argv[2]}{len(made)}"))
        open(made[-1], "w").close()
        time.sleep(0.2)
finally:
    for path in made:
        os.remove(path)
    print(len(made))
"""


def test_the_run_and_its_subprocesses_have_a_private_temp_folder():
    assert tempfile.gettempdir() == TEST_TEMP and TEST_TEMP.startswith(os.path.join(ROOT, ".pytest_tmp") + os.sep)
    child = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == TEST_TEMP


def _copy_as_a_clone(folder: str) -> str:
    """What the tests need of this checkout, under `folder`, with the venv (if any) at .venv; returns its python."""
    ignore = shutil.ignore_patterns("__pycache__")
    for name in ("mpzero", "tests"):
        shutil.copytree(os.path.join(ROOT, name), os.path.join(folder, name), ignore=ignore)
    for name in ("pretrain_gpt.py", "pytest.ini"):
        shutil.copy(os.path.join(ROOT, name), folder)
    if sys.prefix == sys.base_prefix:  # no venv: the system's python, the folder's name still in every frame
        return sys.executable
    os.symlink(sys.prefix, os.path.join(folder, ".venv"))
    return os.path.join(folder, ".venv", "bin", os.path.basename(sys.executable))


@pytest.mark.slow  # a nested pytest with one 2-node torchrun job: about 20 s on 2 cores
def test_tests_pass_in_a_clone_named_mpzero_while_another_process_writes_to_the_temp_folder(tmp_path):
    clone = tmp_path / "mpzero"
    clone.mkdir()
    python = _copy_as_a_clone(str(clone))
    prefix = f"mpzero-clone-test-{os.getpid()}-"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, SYSTEM_TEMP, prefix], stdout=subprocess.PIPE, text=True)
    env = {**{k: v for k, v in os.environ.items() if k not in ("TEMP", "TMP", "PYTHONPATH")}, "TMPDIR": SYSTEM_TEMP}
    try:
        run = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider"] + NESTED, cwd=clone, env=env,
                             capture_output=True, text=True, timeout=240)
    finally:
        writer.terminate()
        written = writer.communicate(timeout=30)[0]
        for path in glob.glob(os.path.join(SYSTEM_TEMP, prefix + "*")):  # a writer killed before its cleanup
            os.remove(path)
    assert run.returncode == 0 and f"{len(NESTED)} passed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    assert int(written) >= 2, "the writer made too few files to prove anything"
    assert not [n for n in os.listdir(clone / ".pytest_tmp") if n.startswith("tmp-")], "the private folder stayed"
