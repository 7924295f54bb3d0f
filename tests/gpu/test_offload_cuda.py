"""The offload tiers on a GPU through pretrain_gpt.main (world of one): gradients leave the device on a side stream
(stages 2-3: each reduced bucket streamed to pinned host memory in backward; stage 1: through pinned staging
buffers in the step), AdamW runs on the CPU, parameters come back host-to-device. Losses equal the
in-memory run (fp32, within 1e-5 relative: the in-memory step runs AdamW on the GPU, in another rounding order
than the CPU's), the device holds only its share of the formula (the optimizer's 12P/N is off it, counted in
host memory or on disk, and at stages 2-3 the gradients' gP/N), and the device<->host traffic equals its theory
(down: m gP/N streamed at stages 2-3, 4P/N at stage 1; up: pP/N)."""

import re

import pytest

import pretrain_gpt
from tests.gpu.common import DEVICE, SMALL, needs_cuda

pytestmark = needs_cuda

MODES = {
    "optimizer cpu, stage 2": ["--zero-stage", "2", "--offload-optimizer", "cpu"],
    "optimizer disk, stage 1": ["--zero-stage", "1", "--offload-optimizer", "disk", "--offload-sub-group-numel", "4096"],
    "optimizer + params cpu, stage 3": ["--zero-stage", "3", "--offload-optimizer", "cpu", "--offload-params", "cpu"],
    "optimizer + params disk, stage 3": ["--zero-stage", "3", "--offload-optimizer", "disk", "--offload-params",
                                         "disk", "--offload-sub-group-numel", "5000"],
}



def _fields(line: str) -> dict[str, str]:
    return dict(field.strip().rsplit(" ", 1) for field in line.split("|")[1:])


@pytest.fixture(scope="module")
def in_memory(world):
    return {stage: pretrain_gpt.main(SMALL + ["--train-iters", "10", "--zero-stage", stage])["losses"]
            for stage in ("1", "2", "3")}


@pytest.mark.parametrize("mode", list(MODES))
def test_offloaded_training_on_the_gpu_matches_memory(world, in_memory, mode, tmp_path, capsys):
    flags = MODES[mode] + (["--offload-path", str(tmp_path)] if "disk" in mode else [])
    history = pretrain_gpt.main(SMALL + ["--train-iters", "10", "--log-interval", "10"] + flags)
    out = capsys.readouterr().out
    reference = in_memory[flags[1]]
    for got, want in zip(history["losses"], reference):
        assert abs(got - want) <= 1e-5 * abs(want), (mode, history["losses"], reference)
    memory = _fields(next(line for line in out.splitlines() if line.startswith("zero memory")))
    assert 1.0 <= float(memory["ratio"]) < 1.02, memory  # the device's share only
    tier = "disk" if "disk" in mode else "host"
    assert 1.0 <= float(memory[f"{tier} ratio"]) < 1.02, memory
    assert int(memory["host-buffers bytes"]) == int(memory["host-buffers formula bytes"]), memory
    comm = _fields(next(line for line in out.splitlines() if line.startswith("zero comm")))
    for name in ("device-to-host", "host-to-device"):
        if DEVICE.type == "cuda":  # on the CPU (MPZERO_GPU_TESTS_ON_CPU) the device is host memory: no traffic
            assert float(comm[f"{name} theory bytes/iter"]) > 0, comm
        assert float(comm[f"{name} ratio"]) == pytest.approx(1.0, abs=0.02), comm
    assert re.search(r"iteration +10/", out)
