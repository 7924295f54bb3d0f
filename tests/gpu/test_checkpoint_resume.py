"""A checkpoint saved on the GPU reloads and resumes bitwise: 20 iterations straight equal 10 iterations,
--save + --exit-interval 10, then --load for the last 10, loss for loss (==, not approximately). Dropout is on,
so the CUDA generator states must come back too; fp16 also restores the loss scaler."""

import pytest

import pretrain_gpt
from tests.gpu.common import SMALL, needs_cuda

pytestmark = needs_cuda


@pytest.mark.parametrize("precision, stage", [("--bf16", 1), ("--fp16", 3), ("--bf16", 2)])
def test_resume_is_bitwise(precision, stage, tmp_path):
    flags = SMALL + [precision, "--zero-stage", str(stage), "--train-iters", "20", "--hidden-dropout", "0.1",
                     "--attention-dropout", "0.1"]
    if precision == "--fp16":
        flags += ["--initial-loss-scale", "65536"]
    straight = pretrain_gpt.main(flags)
    ckpt = str(tmp_path / "ckpt")
    first = pretrain_gpt.main(flags + ["--save", ckpt, "--exit-interval", "10"])
    second = pretrain_gpt.main(flags + ["--load", ckpt, "--save", ckpt])
    assert first["losses"] == straight["losses"][:10]
    assert second["losses"] == straight["losses"][10:], (second["losses"], straight["losses"][10:])
    assert second["grad_norms"] == straight["grad_norms"][10:]
