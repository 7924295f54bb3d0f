"""A peer that exits in the middle of a run, for the shared-memory transports' tests (comm_shm, comm_shm_collectives):
rank 0 leaves without a word once rank 1 is past its setup's collectives (not inside one); rank 1 waits for it, and
reports how long until the wait raised and what it said.

    with pytest.raises(RanksFailed, match="rank 0 ---\\nprocess died"):
        run_ranks(2, fn, str(tmp_path / "report"), deadline=30)   # fn: set up, then exit_or_wait(...)
    seconds, message = waited(tmp_path / "report")
"""

import os
import time

from mpzero.comm_shm import P2PTimeout


def exit_or_wait(report: str, rank: int, wait) -> None:
    ready = report + ".ready"
    if rank == 0:
        end = time.monotonic() + 20
        while not os.path.exists(ready) and time.monotonic() < end:
            time.sleep(0.01)
        os._exit(0)  # gone without a word
    open(ready, "w").close()
    started = time.monotonic()
    try:
        wait()
    except P2PTimeout as error:
        with open(report, "w") as f:
            f.write(f"{time.monotonic() - started:.1f} {error}")
    os._exit(0)  # not waiting for the gone peer at the harness's exit


def waited(report) -> tuple[float, str]:
    seconds, message = report.read_text().split(" ", 1)
    return float(seconds), message
