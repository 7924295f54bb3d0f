"""The chunked cross entropy's fused arithmetic (`mpzero.fused.cross_entropy`, impl "compile": torch.compile,
inductor's C++ backend on this CPU) against its reference (impl "torch"): losses, input and weight gradients at TP
1 and 2 with sequence parallelism, a chunk size that does not divide the tokens, padding rows on the last shard,
targets on either shard, a loss gradient of its own per token, in fp32 and bf16; the kept last chunk; the flag
through the CLI.

Tolerance: fp32 within 1e-6 (the compiled passes sum each row in another order, ~1e-7 relative); bf16: the same
bf16 logits, the gradient rounded to bf16 from fp32 values within 1e-6 of each other, so at most one bf16 ulp
(2^-8 relative) apart, and every product after it within a few ulps of the tensor's largest element."""

import pytest
import torch

from mpzero.errors import ConfigError
from mpzero.fused import CrossEntropyMath, cross_entropy_math
from mpzero.fused.cross_entropy import FusedCrossEntropyMath
from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import gather_full, vocab_parallel_linear_cross_entropy
from mpzero.tensor_parallel.mappings import split_sequence
from tests.cli import TINY, assert_close_lists, exit_code_and_stderr, main_capturing_stdout
from tests.distributed import run_ranks

TOL = dict(rtol=1e-6, atol=1e-6)
B, S, H, VOCAB, PADDED = 3, 8, 16, 50, 64  # 24 tokens; 14 padding rows, all on the last shard
CHUNK = 5  # five chunks, the last of 4 tokens


def _impls(tp_size, sequence_parallel, dtype, retain):
    """{impl: (losses, input gradient, full weight gradient[, the second backward's])} for torch and compile."""
    tp = init_parallel(tp_size).tp
    g = torch.Generator().manual_seed(0)
    x_full = torch.randn(B, S, H, generator=g)
    weight_full = torch.randn(PADDED, H, generator=g) * 0.5
    weight_full[VOCAB:] = 0.0  # the model's padding rows
    target = torch.randint(0, VOCAB, (B, S), generator=g)
    grad = torch.rand(B, S, generator=g)  # a loss gradient of its own for every token
    out = {}
    for impl in ("torch", "compile"):
        x = (split_sequence(x_full, tp) if sequence_parallel else x_full).to(dtype).requires_grad_()
        weight = weight_full.chunk(tp.size)[tp.rank].to(dtype).requires_grad_()
        losses = vocab_parallel_linear_cross_entropy(x, weight, target, tp, VOCAB, CHUNK, sequence_parallel, impl)
        first = torch.autograd.grad(losses, (x, weight), grad.to(losses.dtype), retain_graph=retain)
        result = [losses.detach().float(), first[0].float(), gather_full(first[1], 0, tp).float()]
        if retain:  # a second backward finds the kept chunk released and recomputes it
            second = torch.autograd.grad(losses, (x, weight), grad.to(losses.dtype))
            result += [second[0].float(), gather_full(second[1], 0, tp).float()]
        out[impl] = result
    return out


@pytest.mark.parametrize("tp_size, sequence_parallel", [
    (1, False), pytest.param(2, True, marks=pytest.mark.product)])  # each process compiles anew: ~15 s
def test_fused_cross_entropy_matches_the_reference(tp_size, sequence_parallel):
    for out in run_ranks(tp_size, _impls, tp_size, sequence_parallel, torch.float32, tp_size == 1, deadline=300):
        for fused, reference in zip(out["compile"], out["torch"]):
            torch.testing.assert_close(fused, reference, **TOL)
        assert out["compile"][2][VOCAB:].abs().sum() == 0  # the padding rows get no gradient


def _compiled_calls_forward_and_backward():
    """(compiled calls in forward, in backward) of the fused loss at TP 1 over 5 chunks."""
    import mpzero.fused.cross_entropy as fused_module
    calls, compile_once = [], fused_module.compiled

    def counting(fn):
        compiled_fn = compile_once(fn)
        return lambda *args: calls.append(fn.__name__) or compiled_fn(*args)
    fused_module.compiled = counting
    try:
        tp = init_parallel(1).tp
        g = torch.Generator().manual_seed(0)
        x = torch.randn(B, S, H, generator=g, requires_grad=True)
        weight = (torch.randn(PADDED, H, generator=g) * 0.5).requires_grad_()
        losses = vocab_parallel_linear_cross_entropy(x, weight, torch.randint(0, VOCAB, (B, S), generator=g), tp,
                                                     VOCAB, CHUNK, False, "compile")
        forward = list(calls)
        losses.sum().backward()
        return forward, calls[len(forward):]
    finally:
        fused_module.compiled = compile_once


@pytest.mark.product  # its own process compiles the graphs anew: ~20 s
def test_the_fused_forward_at_tp1_is_one_compiled_call_for_all_its_chunks():
    """Host time a GPU step waits for: at TP 1 the five chunks' forward is one compiled region (not three calls a
    chunk); backward is one a chunk (the kept chunk's gradient, then each other chunk's recomputed one)."""
    forward, backward = run_ranks(1, _compiled_calls_forward_and_backward, deadline=300)[0]
    assert forward == ["_fused_local_chunks"]
    assert backward == ["_fused_grad_from_kept"] + ["_fused_grad"] * 4


@pytest.mark.product
def test_fused_cross_entropy_in_bf16_is_within_a_rounding_of_the_reference():
    out = run_ranks(1, _impls, 1, False, torch.bfloat16, False, deadline=300)[0]
    fused, reference = out["compile"], out["torch"]
    torch.testing.assert_close(fused[0], reference[0], **TOL)  # the loss: fp32 from the same bf16 logits
    for got, want in zip(fused[1:], reference[1:]):
        torch.testing.assert_close(got, want, rtol=0, atol=2 ** -6 * want.abs().max().item())


def test_auto_is_the_reference_on_cpu_fused_on_cuda_and_an_unknown_impl_is_refused():
    assert type(cross_entropy_math("cpu")) is CrossEntropyMath
    assert type(cross_entropy_math("cuda")) is FusedCrossEntropyMath  # measured 2.9x on an H100
    with pytest.raises(ConfigError, match="unknown impl 'triton' for cross_entropy"):
        cross_entropy_math("cpu", "triton")


def _history(argv):
    return main_capturing_stdout(argv)


@pytest.mark.product
def test_cross_entropy_loss_fusion_through_the_cli_matches_the_reference_at_tp2_sp():
    """pretrain_gpt --cross-entropy-loss-fusion, TP 2 with sequence parallelism, ZeRO-1, fp32, 32 tokens a
    micro-batch in chunks of 5: the reference run's losses and gradient norms within 1e-5 relative, and the
    `fused ops` line says which arithmetic ran."""
    flags = TINY + ["--train-iters", "3", "--eval-iters", "0", "--tensor-model-parallel-size", "2",
                    "--sequence-parallel", "--zero-stage", "1", "--cross-entropy-chunk-size", "5"]
    reference, plain_out = run_ranks(2, _history, flags, deadline=300)[0]
    fused, fused_out = run_ranks(2, _history, flags + ["--cross-entropy-loss-fusion"], deadline=300)[0]
    assert_close_lists(fused["losses"], reference["losses"], rel=1e-5)
    assert_close_lists(fused["grad_norms"], reference["grad_norms"], rel=1e-5)
    assert '"cross_entropy": "compile"' in fused_out and '"cross_entropy": "torch"' in plain_out


def test_cross_entropy_loss_fusion_without_chunks_is_one_line_before_any_work():
    code, err = exit_code_and_stderr(TINY + ["--cross-entropy-loss-fusion", "--cross-entropy-chunk-size", "0"])
    assert code != 0 and "--cross-entropy-loss-fusion fuses the chunked loss's arithmetic: it needs " \
                         "--cross-entropy-chunk-size > 0" in err and len(err.strip().splitlines()) == 1, err
