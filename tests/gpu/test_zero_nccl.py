"""ZeRO stages 0-3 through pretrain_gpt.main over NCCL in a world of one: each trains (losses fall) and all
four print the same losses (fp32, within 1e-5 relative), and their `zero memory` lines sit at the formula."""

import re

import pretrain_gpt
from tests.gpu.common import SMALL, needs_cuda

pytestmark = needs_cuda



def test_zero_stages_over_nccl_give_the_same_losses(world, capsys):
    losses = {}
    for stage in (0, 1, 2, 3):
        history = pretrain_gpt.main(SMALL + ["--train-iters", "10", "--zero-stage", str(stage)])
        out = capsys.readouterr().out
        assert re.search(rf"^zero memory \| stage {stage} \| dp 1 \| .* \| ratio 1\.00\d+ \|", out, re.M), out
        losses[stage] = history["losses"]
        assert history["losses"][-1] < history["losses"][0]
    for stage in (1, 2, 3):
        for got, want in zip(losses[stage], losses[0]):
            assert abs(got - want) <= 1e-5 * abs(want), (stage, losses[stage], losses[0])
