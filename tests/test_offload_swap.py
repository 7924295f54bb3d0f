"""Swap files (mpzero/zero/offload/swap.py): unaligned reads and writes through buffered and direct I/O leave the
bytes around them alone; O_DIRECT refused by a file system, a full disk at preallocation and during a write are one
line each, naming the path and what to do (the disk tier's files through a whole run: tests/test_offload_files.py)."""

import errno
import os

import pytest
import torch

from mpzero.errors import ConfigError, TrainingError
from mpzero.zero.offload.swap import SwapFile, aligned_empty, disk_error_message


@pytest.mark.parametrize("io", ["buffered", "direct"])
def test_swap_file_unaligned_ranges(tmp_path, io):
    f = SwapFile(str(tmp_path / "swap.bin"), 10000, io)
    try:
        assert f.nbytes == 12288 and os.path.getsize(f.path) == 12288 and f.direct == (io == "direct")
        mirror = torch.zeros(f.nbytes, dtype=torch.uint8)
        gen = torch.Generator().manual_seed(0)
        for offset, n in [(0, 4096), (3, 5), (4000, 200), (100, 8000), (12287, 1), (4096, 4096)]:
            values = torch.randint(0, 255, (n,), dtype=torch.uint8, generator=gen)
            f.write(offset, values)
            mirror[offset:offset + n] = values
            out = torch.empty(n, dtype=torch.uint8)
            f.read(offset, out)
            assert torch.equal(out, values)
        whole = aligned_empty(f.nbytes, torch.uint8)
        assert whole.data_ptr() % 4096 == 0
        f.read(0, whole)
        assert torch.equal(whole, mirror)  # no write disturbed the bytes around it
        with pytest.raises(ValueError, match="outside"):
            f.write(12000, torch.zeros(1000, dtype=torch.uint8))
    finally:
        f.close(remove=True)


def _refuses_o_direct(directory):
    try:
        fd = os.open(os.path.join(directory, "mpzero-direct-probe"), os.O_RDWR | os.O_CREAT | os.O_DIRECT)
    except OSError as error:
        return error.errno == errno.EINVAL
    os.close(fd)
    os.remove(os.path.join(directory, "mpzero-direct-probe"))
    return False


def test_direct_io_refused_is_one_line():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm (tmpfs) here")
    if not _refuses_o_direct("/dev/shm"):
        pytest.skip("tmpfs accepts O_DIRECT on this kernel (Linux 6.6 and later): no file system here refuses it")
    path = f"/dev/shm/mpzero-test-{os.getpid()}.bin"
    with pytest.raises(ConfigError) as error:
        SwapFile(path, 4096, "direct")
    message = str(error.value)
    assert "\n" not in message and "--offload-io direct" in message and path in message
    assert "--offload-io buffered" in message
    f = SwapFile(path, 4096, "auto")
    assert not f.direct
    f.close(remove=True)


def test_disk_full_is_one_line(tmp_path, monkeypatch):
    """ENOSPC at preallocation (no honest way to fill a disk in a unit test: posix_fallocate is made to refuse)."""
    message = disk_error_message(str(tmp_path / "master.bin"), 123456, errno.ENOSPC, 5 << 20)
    assert "\n" not in message and str(tmp_path / "master.bin") in message and "120.6 KiB" in message
    assert "--offload-path" in message and "5.0 MiB free" in message and "ENOSPC" in message

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    for io in ("buffered", "auto"):
        with pytest.raises(ConfigError, match="needs 8.0 KiB") as error:
            SwapFile(str(tmp_path / "x.bin"), 5000, io)
        assert "\n" not in str(error.value) and "--offload-path" in str(error.value)
        assert not os.path.exists(tmp_path / "x.bin")  # the half-made file is removed


def test_disk_full_during_a_write_is_a_training_error(tmp_path, monkeypatch):
    f = SwapFile(str(tmp_path / "y.bin"), 4096, "buffered")

    def full(fd, buffers, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(TrainingError, match="--offload-path"):
        f.write(0, torch.zeros(16, dtype=torch.uint8))
    f.close(remove=True)
