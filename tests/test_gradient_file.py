"""Gradients on disk (issue 24, ZeRO-Infinity's gradient offload): with the optimizer on disk at stages 2-3, each
reduced gradient slice is streamed through host memory into the run's gradient file, so no rank holds its gradient
partition anywhere but in that file and two region buffers. The run is bit for bit the in-memory one (2
micro-batches: the file accumulates them; the norm summed as the final slices arrive; low-precision gradients cast
as the step reads them); the memory and traffic lines put gP/N on disk against their formulas; the file itself
keeps every region aligned and reads back what was written, in any order. (The planner predicts these lines
exactly: tests/test_planner.py; the delayed update snapshots gradients from the file: tests/test_delayed_update.py;
a gradient file cut short stops the next save: tests/test_offload_files.py.)"""

import os

import pytest
import torch

from mpzero.zero.offload.directory import OffloadDirectory
from mpzero.zero.offload.grad_file import FILE_NAME, GradFile
from mpzero.zero.offload.swap import ALIGN, aligned_bytes
from tests.cli import TINY
from tests.test_offload_cli import SUB_GROUP, _assert_identical, _fields, _run


def test_regions_are_aligned_and_read_back_what_was_written_in_any_order(tmp_path):
    directory = OffloadDirectory(str(tmp_path / "rank00000"))
    numels = [1000, 5, 3000, 2048, 1]
    grads = GradFile(directory, numels, torch.bfloat16, "auto")
    try:
        assert all(offset % ALIGN == 0 for offset in grads.offsets)
        assert grads.nbytes == sum(-(-2 * n // ALIGN) * ALIGN for n in numels)
        assert grads.host_buffer_formula()[0] == 2 * aligned_bytes(3000, torch.bfloat16)
        written = [torch.randn(n).to(torch.bfloat16) for n in numels]
        for bucket in (3, 0, 4, 1, 2):  # backward delivers buckets in any order; each region written whole
            grads.buffers[0][:numels[bucket]].copy_(written[bucket])
            grads.write(bucket, grads.buffers[0])
        reader = grads.reader()
        for bucket in (0, 1, 2, 3, 4, 2, 0):  # in order (read ahead), then out of order (read now)
            assert torch.equal(reader.slice(bucket), written[bucket]), bucket
        reader.wait()
        assert sorted(os.listdir(directory.path)) == [FILE_NAME]
    finally:
        grads.close()
        directory.close()
    assert not os.path.exists(tmp_path / "rank00000")


OFFLOAD = ["--offload-optimizer", "disk"] + SUB_GROUP


@pytest.mark.parametrize("stage,flags", [(2, ["--bf16", "--grad-reduce-in-bf16"]), (3, ["--fp16"])])
def test_gradients_on_disk_train_bitwise_as_in_memory(tmp_path, stage, flags):
    """bf16 gradient buffers (the step casts pieces read back from the file) and fp16 (the overflow check and the
    norm summed as slices arrive, unscaled by the loss scale), 2 micro-batches at DP 2, clipping on. The exact
    disk and buffer bytes are the planner's (tests/test_planner.py)."""
    argv = TINY + flags + ["--zero-stage", str(stage), "--micro-batch-size", "1", "--global-batch-size", "4",
                           "--clip-grad", "0.5", "--zero-bucket-numel", "3000"]
    offload = OFFLOAD + ["--offload-path", str(tmp_path / "swap")]
    if stage == 3:
        offload += ["--offload-params", "disk"]
    offloaded = _run(tmp_path, "offloaded", 2, argv + offload)
    _assert_identical(offloaded, _run(tmp_path, "in-memory", 2, argv))
    memory = _fields(next(line for line in offloaded[1].splitlines() if line.startswith("zero memory")))
    states = 12 + (2 if stage == 3 else 0) + 2  # masters and moments, stage 3's parameters, 2-byte gradients
    assert memory["disk formula"] == f"{states}P/N" and "host formula" not in memory, memory
    assert 1.0 <= float(memory["disk ratio"]) < 1.2, memory  # 4 KiB alignment of ~14 buckets' regions
    assert int(memory["host-buffers bytes"]) == int(memory["host-buffers formula bytes"])
    assert not os.path.exists(tmp_path / "swap") or os.listdir(tmp_path / "swap") == []

