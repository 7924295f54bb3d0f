"""Shared test set-up: one intra-op thread (forked ranks deadlock otherwise) and lazy first-call
costs paid once here, before any rank is forked.

Without a GPU, Triton kernels run under Triton's interpreter: TRITON_INTERPRET must be set before
triton is first imported (its own library functions are decorated then), and the torch.optim warm-up
below already imports it, so it is set first thing here."""

import atexit
import getpass
import os
import shutil
import tempfile

import pytest
import torch

# One inductor cache for the whole run (torch.compile's tests and the fused ops' compile impls share it; forked
# ranks inherit it), in the temp folder while the run lasts and removed after it.
INDUCTOR_CACHE = tempfile.mkdtemp(prefix="mpzero-tests-inductor-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = INDUCTOR_CACHE
# Some of inductor's caches ignore that variable and use the temp folder's torchinductor_<user>: made by this run,
# it goes with the run (atexit: also when every test was skipped and no fixture ran).
TORCH_DEFAULT_CACHE = os.path.join(tempfile.gettempdir(), "torchinductor_" + getpass.getuser())
_MADE_HERE = [INDUCTOR_CACHE] + ([] if os.path.exists(TORCH_DEFAULT_CACHE) else [TORCH_DEFAULT_CACHE])


def _remove_caches() -> None:
    for folder in _MADE_HERE:
        shutil.rmtree(folder, ignore_errors=True)


atexit.register(_remove_caches)
# Inductor compiles in the calling process, never in a worker pool: ranks are forked, and a child forked after the
# parent started the pool waits on it forever.
os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)
torch.testing.assert_close(torch.zeros(1), torch.zeros(1))
torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])


@pytest.fixture(scope="session", autouse=True)
def temp_folder_left_as_found():
    """`make test` leaves nothing in the temp folder: every test cleans up what it makes there (pytest's own
    tmp_path directories live under --basetemp, in the repository: pytest.ini)."""
    folder = tempfile.gettempdir()
    before = set(os.listdir(folder)) | {os.path.basename(INDUCTOR_CACHE)}
    yield
    _remove_caches()
    left = sorted(set(os.listdir(folder)) - before)
    assert not left, f"the tests left {len(left)} entries in {folder}: {', '.join(left[:5])}"
