"""fp16 with dynamic loss scaling and bf16, 20 iterations each on the GPU: every loss finite, the loss falls
(the last 5 iterations' mean below the first iteration's), fp16 steps that overflow are skipped."""

import math

import pytest

import pretrain_gpt
from tests.gpu.common import SMALL, needs_cuda

pytestmark = needs_cuda


@pytest.mark.parametrize("precision", [["--fp16", "--initial-loss-scale", "1048576", "--hysteresis", "1"], ["--bf16"]],
                         ids=["fp16-dynamic", "bf16"])
@pytest.mark.parametrize("stage", [1, 3])
def test_twenty_steps_train(precision, stage, capsys):
    history = pretrain_gpt.main(SMALL + precision + ["--train-iters", "20", "--zero-stage", str(stage)])
    out = capsys.readouterr().out
    losses, norms = history["losses"], history["grad_norms"]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses), losses
    applied = [x for x, norm in zip(losses, norms) if norm is not None]
    skipped = len(losses) - len(applied)
    print(f"{precision[0]} stage {stage}: {skipped} skipped (overflow) steps, losses {losses}")
    assert len(applied) >= 10, f"{skipped} of 20 steps skipped: {out[-2000:]}"
    assert sum(losses[-5:]) / 5 < losses[0], losses
