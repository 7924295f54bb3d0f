"""Shared test set-up: a private temp folder for the whole run, one intra-op thread (forked ranks deadlock
otherwise) and lazy first-call costs paid once here, before any rank is forked.

The run's temp folder is its own, `.pytest_tmp/tmp-PID` in the repository (ignored by git): TMPDIR, TEMP and TMP
name it before anything else is imported, so this process, its forked ranks and every subprocess (torchrun's
agents included) make their temp files there, and the suite asserts that it leaves that folder empty. Whatever else
runs on the machine may write to the system's temp folder meanwhile; the suite neither reads nor judges it.

Without a GPU, Triton kernels run under Triton's interpreter: TRITON_INTERPRET must be set before
triton is first imported (its own library functions are decorated then), and the torch.optim warm-up
below already imports it, so it is set first thing here."""

import atexit
import getpass
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM_TEMP = tempfile.gettempdir()  # the machine's, before it is replaced: tests/test_clone_anywhere.py writes there
_TEMP_PARENT = os.path.join(ROOT, ".pytest_tmp")  # pytest's own tmp_path folders: its base/ (pytest.ini)


def _remove_dead_runs_folders() -> None:
    """A run killed before its end leaves its tmp-PID folder: removed once its process is gone."""
    for name in os.listdir(_TEMP_PARENT):
        pid = name[len("tmp-"):]
        if not (name.startswith("tmp-") and pid.isdigit()):
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(_TEMP_PARENT, name), ignore_errors=True)
        except PermissionError:  # a live process of another user
            pass


os.makedirs(_TEMP_PARENT, exist_ok=True)
_remove_dead_runs_folders()
TEST_TEMP = os.path.join(_TEMP_PARENT, f"tmp-{os.getpid()}")
shutil.rmtree(TEST_TEMP, ignore_errors=True)  # a dead run's that had this pid
os.mkdir(TEST_TEMP)
for _name in ("TMPDIR", "TEMP", "TMP"):
    os.environ[_name] = TEST_TEMP
tempfile.tempdir = None  # gettempdir() reads the variables again

import multiprocessing.util  # noqa: E402
import pytest  # noqa: E402 - after the temp folder is set: both may make temp files on import
import torch  # noqa: E402

# One inductor cache for the whole run (torch.compile's tests and the fused ops' compile impls share it; forked
# ranks inherit it), in the run's temp folder, removed after it with the torchinductor_<user> folder that some of
# inductor's caches make there whatever that variable says.
INDUCTOR_CACHE = tempfile.mkdtemp(prefix="mpzero-tests-inductor-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = INDUCTOR_CACHE
_CACHES = (os.path.basename(INDUCTOR_CACHE), "torchinductor_" + getpass.getuser())


def _remove_caches() -> None:
    for name in _CACHES:
        shutil.rmtree(os.path.join(TEST_TEMP, name), ignore_errors=True)


@atexit.register  # also when no test ran (the fixture below did not); a folder left with files is kept to be read
def _remove_the_folder_if_empty() -> None:
    _remove_caches()
    if os.path.isdir(TEST_TEMP) and not os.listdir(TEST_TEMP):
        os.rmdir(TEST_TEMP)


# and again after multiprocessing removed its own folder there (its fork server's, tests/distributed.py under a GPU
# build of torch): its exit handler runs after this file's (registered first) and removes that folder at priority -100
multiprocessing.util.Finalize(None, _remove_the_folder_if_empty, exitpriority=-101)


# Inductor compiles in the calling process, never in a worker pool: ranks are forked, and a child forked after the
# parent started the pool waits on it forever.
os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)
torch.testing.assert_close(torch.zeros(1), torch.zeros(1))
torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])


@pytest.fixture(scope="session", autouse=True)
def temp_folder_left_empty():
    """Every test cleans up what it makes in the temp folder: the run's own is empty at the end but for the
    caches this file made there (removed, with the folder, when the run ends; pytest's tmp_path folders live
    under --basetemp) and the two folders importing wandb makes in this process (megatron-core imports it when
    tests/test_import_megatron.py is collected; wandb removes them itself when the process ends), and
    multiprocessing's own folder, which it removes at the end too (a fork server's socket: tests/distributed.py)."""
    yield
    _remove_caches()
    wandb_keeps = ("wandb-media", "wandb-artifacts") if "wandb" in sys.modules else ()
    left = sorted(name for name in os.listdir(TEST_TEMP) if not (name.startswith("tmp") and name.endswith(wandb_keeps))
                  and not name.startswith("pymp-"))
    assert not left, f"the tests left {len(left)} entries in {TEST_TEMP}: {', '.join(left[:5])}"


@pytest.fixture(scope="session")
def megatron_checkpoint(tmp_path_factory):
    """A tiny LLaMA-shaped checkpoint the real megatron-core writes (tests/megatron_core.py, TP 1 x PP 1) and the
    flags tools/import_megatron.py reads it with, made once for the tests that run every tool (~25 s); skipped
    without megatron-core. megatron-core imports wandb, which makes temporary folders that only a normal exit
    removes: its ranks (forked) make theirs in the fixture's own folder, not the temp folder."""
    import importlib.util
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core is not installed (pip install -e '.[test]')")
    from tests.megatron_core import LLAMA, megatron_world
    base = tmp_path_factory.mktemp("megatron")
    root, tempdir = base / "megatron", tempfile.tempdir
    tempfile.tempdir = str(base)
    try:
        megatron_world(LLAMA, 1, 1, str(root), torch.randint(0, 100, (2, 16),
                                                             generator=torch.Generator().manual_seed(0)))
    finally:
        tempfile.tempdir = tempdir
    flags = ["--num-attention-heads", "4", "--position-embedding-type", "rope", "--max-position-embeddings", "32",
             "--rotary-base", "500000", "--norm-epsilon", "1e-6", "--vocab-size", "100"]
    return root, flags
