"""The chunked output projection + cross entropy (`vocab_parallel_linear_cross_entropy`) against the logits path
it replaces (F.linear, the -inf vocabulary padding, `vocab_parallel_cross_entropy`): losses, input and weight
gradients at TP 1 and 2, with sequence parallelism, chunk sizes that do not divide the tokens, padding rows on
a shard, targets on either shard, a different loss gradient per token; then the GPT (tied and untied).

Tolerance: fp32 within 1e-6. The forward and the input gradient are the logits path's arithmetic row by row; the
weight gradient sums the chunks' products (one matmul in the logits path), a different order of fp32 sums."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from mpzero.models import GPTConfig, GPTModel
from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import (copy_to_tp, gather_full, linear_with_sequence_gather, seed_everything,
                                    vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy)
from mpzero.tensor_parallel.mappings import split_sequence
from tests.distributed import run_ranks

TOL = dict(rtol=1e-6, atol=1e-6)
B, S, H, VOCAB, PADDED = 3, 8, 16, 50, 64  # 24 tokens; 14 padding rows, all on the last shard


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, S, H, generator=g)
    weight = torch.randn(PADDED, H, generator=g) * 0.5
    weight[VOCAB:] = 0.0  # the model's padding rows
    target = torch.randint(0, VOCAB, (B, S), generator=g)
    grad = torch.rand(B, S, generator=g)  # a loss gradient of its own for every token (a loss mask, a weighting)
    return x, weight, target, grad


def _logits_path(x, weight, target, tp, sequence_parallel):
    if sequence_parallel:
        logits = linear_with_sequence_gather(x, weight, None, tp)
    else:
        logits = F.linear(copy_to_tp(x, tp), weight)
    first_padding = VOCAB - tp.rank * weight.size(0)
    logits = logits.masked_fill(torch.arange(weight.size(0)) >= first_padding, float("-inf"))
    return vocab_parallel_cross_entropy(logits, target, tp)


def _both_paths(tp_size, sequence_parallel, chunk_size):
    """(losses, input gradient, full weight gradient) of the logits path and of the chunked one."""
    tp = init_parallel(tp_size).tp
    x_full, weight_full, target, grad = _inputs()
    results = []
    for path in ("logits", "chunked"):
        x = (split_sequence(x_full, tp) if sequence_parallel else x_full).clone().requires_grad_()
        weight = weight_full.chunk(tp.size)[tp.rank].clone().requires_grad_()
        if path == "logits":
            losses = _logits_path(x, weight, target, tp, sequence_parallel)
        else:
            losses = vocab_parallel_linear_cross_entropy(x, weight, target, tp, VOCAB, chunk_size, sequence_parallel)
        losses.backward(grad)
        results.append((losses.detach(), x.grad, gather_full(weight.grad, 0, tp)))
    return results


@pytest.mark.parametrize("tp_size, sequence_parallel", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("chunk_size", [5, 24, 100])
def test_linear_cross_entropy_matches_the_logits_path(tp_size, sequence_parallel, chunk_size):
    for (losses, grad_x, grad_w), (ref_losses, ref_grad_x, ref_grad_w) in run_ranks(
            tp_size, _both_paths, tp_size, sequence_parallel, chunk_size):
        torch.testing.assert_close(losses, ref_losses, **TOL)
        torch.testing.assert_close(grad_x, ref_grad_x, **TOL)
        torch.testing.assert_close(grad_w, ref_grad_w, **TOL)
        assert grad_w[VOCAB:].abs().sum() == 0  # the padding rows get no gradient
        if chunk_size >= B * S:  # one chunk: the same operations as the logits path
            assert torch.equal(losses, ref_losses) and torch.equal(grad_x, ref_grad_x)


def _gradients_twice(chunk_size):
    tp = init_parallel(1).tp
    x, weight, target, grad = _inputs()
    x.requires_grad_()
    losses = vocab_parallel_linear_cross_entropy(x, weight.requires_grad_(), target, tp, VOCAB, chunk_size)
    first = torch.autograd.grad(losses, (x, weight), grad, retain_graph=True)
    return first, torch.autograd.grad(losses, (x, weight), grad)


@pytest.mark.parametrize("chunk_size", [5, 100])
def test_the_kept_last_chunk_gives_the_recomputed_bits(chunk_size):
    """Forward keeps the last chunk's exponentials and backward releases them after use; a second backward
    (retain_graph) finds them released and recomputes that chunk too: the same gradients, bit for bit."""
    (first_x, first_w), (second_x, second_w) = run_ranks(1, _gradients_twice, chunk_size)[0]
    assert torch.equal(first_x, second_x) and torch.equal(first_w, second_w)


def _out_of_vocabulary_losses():
    tp = init_parallel(1).tp
    x, weight, target, _ = _inputs()
    target[0, :3] = torch.tensor([-100, VOCAB + 3, PADDED + 7])
    chunked = vocab_parallel_linear_cross_entropy(x, weight, target, tp, VOCAB, 7)
    return chunked, _logits_path(x, weight, target, tp, False)


def test_out_of_vocabulary_targets_behave_as_in_the_logits_path():
    """Neither path ignores a target (no ignore_index): -100 or an id past the vocabulary owns no logit, its loss
    is log sum exp."""
    chunked, ref = run_ranks(1, _out_of_vocabulary_losses)[0]
    torch.testing.assert_close(chunked, ref, **TOL)


CONFIG = GPTConfig(num_layers=2, hidden_size=24, num_attention_heads=4, vocab_size=203, max_position_embeddings=16,
                   hidden_dropout=0.0, attention_dropout=0.0)


def _model_run(tp_size, config, dtype=torch.float32):
    groups = init_parallel(tp_size)
    model = GPTModel(config, groups.tp, seed_everything(5, groups.tp_rank, groups.device)).to(dtype)
    tokens = torch.randint(0, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    losses = model(tokens[:, :-1], tokens[:, 1:])
    losses.mean().backward()
    return losses.detach().float(), {name: gather_full(p.grad, p.partition_dim, groups.tp).float()
                                     for name, p in model.named_parameters()}


@pytest.mark.parametrize("tp_size, change", [
    (1, {}), (1, dict(untie_embeddings_and_output_weights=True)), (2, {}),
    (2, dict(sequence_parallel=True)), (2, dict(sequence_parallel=True, untie_embeddings_and_output_weights=True))])
def test_gpt_with_chunked_cross_entropy_matches_the_logits_path(tp_size, change):
    """20 tokens in chunks of 7; the tied weight also gets the embedding's gradient, summed by autograd."""
    config = dataclasses.replace(CONFIG, **change)
    ref = run_ranks(tp_size, _model_run, tp_size, dataclasses.replace(config, cross_entropy_chunk_size=0))[0]
    chunked = run_ranks(tp_size, _model_run, tp_size, dataclasses.replace(config, cross_entropy_chunk_size=7))[0]
    torch.testing.assert_close(chunked[0], ref[0], **TOL)
    assert chunked[1].keys() == ref[1].keys()
    for name in ref[1]:
        torch.testing.assert_close(chunked[1][name], ref[1][name], rtol=1e-5, atol=1e-6,  # through 2 layers
                                   msg=lambda m: f"{name}: {m}")


def test_gpt_in_bf16_with_chunked_cross_entropy_is_close_to_the_logits_path():
    """bf16: the same bf16 logits and losses; the weight gradient is rounded to bf16 once per chunk (the logits
    path: once), and every gradient after it sees those bits: within a few bf16 roundings (2^-8 relative) of the
    tensor's largest element."""
    ref = run_ranks(1, _model_run, 1, CONFIG, torch.bfloat16)[0]
    chunked = run_ranks(1, _model_run, 1, dataclasses.replace(CONFIG, cross_entropy_chunk_size=7), torch.bfloat16)[0]
    torch.testing.assert_close(chunked[0], ref[0], rtol=0, atol=0)
    for name in ref[1]:
        scale = ref[1][name].abs().max().item()
        torch.testing.assert_close(chunked[1][name], ref[1][name], rtol=0, atol=2 ** -6 * scale,
                                   msg=lambda m: f"{name}: {m}")
