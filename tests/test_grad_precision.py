"""--accumulate-allreduce-grads-in-fp32 / --grad-reduce-in-bf16 (Megatron's names and rule): bf16 gradients
accumulated and reduced in bf16 train through the CLI at every ZeRO stage and at TP 2 x DP 2 like the fp32
gradients of the default, and every layout like one process with the same flags, within TOL; the memory line
counts 2 bytes per gradient element (counted = formula) and the comm line reduces them at 2 bytes.

TOL = 2**-8 relative, one bf16 ulp: bf16 gradient buffers round every addition (micro-batches, DP ranks, bucket
edges, in an order that depends on the layout) to 8 bits of mantissa, ~2**-9 relative each; over 10 iterations
at this size the losses and gradient norms move ~1e-4 (measured), far inside one ulp and far outside fp32's 1e-5.
"""

import pytest
import torch

from mpzero.cli.arguments import parse_args, precision_config
from mpzero.errors import ConfigError
from mpzero.zero.step_grads import Fp32Buckets
from tests.cli import TINY, assert_close_lists, main_capturing_stdout
from tests.distributed import run_ranks

TOL = 2 ** -8
BF16_GRADS = ["--bf16", "--grad-reduce-in-bf16", "--eval-iters", "0"]  # no evaluation: its gathers count as comm
# formula (p = g = 2, K = 12) and DP theory per stage with 2 micro-batches per rank (global 8 = 2 x 2 x DP 2)
FORMULA = {0: ("16P", "(4P)(N-1)/N"), 1: ("4P+12P/N", "(4P)(N-1)/N"), 2: ("2P+14P/N", "(6P)(N-1)/N"),
           3: ("16P/N", "(12P)(N-1)/N")}


@pytest.mark.parametrize("flags,grad_dtype", [
    ([], torch.float32), (["--bf16"], torch.float32), (["--bf16", "--grad-reduce-in-bf16"], torch.bfloat16),
    (["--bf16", "--accumulate-allreduce-grads-in-fp32"], torch.float32), (["--fp16"], torch.float16),
    (["--fp16", "--accumulate-allreduce-grads-in-fp32"], torch.float32)])
def test_gradient_dtype_follows_megatrons_rule(flags, grad_dtype):
    assert precision_config(parse_args(TINY + flags)).grad_dtype == grad_dtype


@pytest.mark.parametrize("flags,message", [
    (["--fp16", "--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 needs --bf16"),
    (["--bf16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"], "not allowed with")])
def test_contradictory_gradient_flags_are_one_line_errors(flags, message):
    with pytest.raises(ConfigError, match=message):
        precision_config(parse_args(TINY + flags))


def _lines(stdout: str, kind: str) -> list[dict]:
    return [dict(f.strip().rsplit(" ", 1) for f in line.split("|")[1:])
            for line in stdout.splitlines() if line.startswith(kind)]


@pytest.fixture(scope="module")
def single_process():
    """World 1 with bf16 gradients, and with the fp32 gradients of the default."""
    return {name: run_ranks(1, main_capturing_stdout, TINY + flags)[0][0]
            for name, flags in (("bf16", BF16_GRADS), ("fp32", BF16_GRADS[:1] + BF16_GRADS[2:]))}


@pytest.mark.parametrize("tp,stage", [(1, 0), (1, 1), (1, 2), (1, 3), (2, 1), (2, 3)])
def test_bf16_gradients_match_one_process_and_fp32_gradients(single_process, tp, stage):
    argv = TINY + BF16_GRADS + ["--tensor-model-parallel-size", str(tp), "--zero-stage", str(stage),
                                "--zero-bucket-numel", "5000"]  # several buckets: Fp32Buckets casts each in turn
    history, stdout = run_ranks(2 * tp, main_capturing_stdout, argv)[0]
    for reference in (single_process["bf16"], single_process["fp32"]):
        assert_close_lists(history["losses"], reference["losses"], rel=TOL)
        assert_close_lists(history["grad_norms"], reference["grad_norms"], rel=TOL)
    memory, comm = _lines(stdout, "zero memory")[-1], _lines(stdout, "zero comm")[-1]
    assert (memory["formula"], memory["ratio"]) == (FORMULA[stage][0], "1.0000"), memory
    assert comm["theory"] == FORMULA[stage][1], comm
    # exactly: the loop's fp32 loss all-reduce over DP is not ZeRO's traffic, and is left out of the line
    assert float(comm["measured bytes/iter"]) == float(comm["theory bytes/iter"]), comm


def test_fp32_buckets_cast_one_bucket_at_a_time_like_casting_all_at_once():
    shards = [torch.randn(n, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16) for n in (5, 7, 3)]
    buckets = Fp32Buckets(shards, inverse_scale=2 ** -10)
    buckets.clip_(0.37)
    for b, shard in enumerate(shards):
        assert torch.equal(buckets[b], shard.float().mul_(2 ** -10).mul_(0.37))
        assert len(buckets._cast) == 1 and buckets.meter.current == 4 * shard.numel()  # the previous one is gone
    assert buckets.meter.peak == 4 * 7


def test_fp32_pieces_are_the_whole_cast_and_at_most_two_stay():
    shards = [torch.randn(n, generator=torch.Generator().manual_seed(n)).to(torch.float16) for n in (50, 70)]
    buckets = Fp32Buckets(shards, inverse_scale=2 ** -12)
    buckets.clip_(0.21)
    for b, lo, hi in [(0, 0, 13), (0, 13, 50), (1, 0, 9), (1, 9, 61), (1, 61, 70)]:
        assert torch.equal(buckets.piece(b, lo, hi), shards[b][lo:hi].float().mul_(2 ** -12).mul_(0.21))
        assert len(buckets._cast) <= 2
    assert buckets.meter.peak == 4 * (9 + 52)
    buckets.release()
    assert buckets.meter.current == 0
