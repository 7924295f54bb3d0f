"""`GPTConfig.flops_per_token` against the matmuls torch really runs (FlopCounterMode) and against Megatron's
formula: every layer, the logits, recomputation (full and selective) and the chunked loss's recomputed chunks."""

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mpzero.deferred_init import materialize_module, name_parameters
from mpzero.models import GPTConfig, GPTModel
from mpzero.models.gpt import transformer_layer
from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import seed_everything
from tests.distributed import run_ranks

NO_DROPOUT = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=203,
                       max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)


def _tokens(seed=1, batch=2, seq=9, vocab=203):
    return torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))


def _counted_flops(config, batch, seq):
    model = GPTModel(config, init_parallel(1).tp, seed_everything(1, 0, torch.device("cpu")))
    tokens = _tokens(batch=batch, seq=seq, vocab=config.vocab_size)
    with FlopCounterMode(display=False) as counter:
        model(tokens[:, :-1], tokens[:, 1:], reduction="mean").backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("untie", [False, True])
@pytest.mark.parametrize("chunk", [2048, 7, 0])
def test_flops_per_token_equals_the_counted_matmuls(recompute, untie, chunk):
    """FlopCounterMode counts 2mnk per matmul (mm, addmm, bmm) of forward and backward; LayerNorm, softmax, GELU,
    the loss and the embedding lookup are not matmuls and are in neither count. They agree exactly: every matmul
    is in the formula (the padded vocabulary's logits included; with the loss in chunks of 7, the 35 of 36 tokens
    outside the last chunk recomputed; in one chunk of 2048, none) and the formula has nothing else. The attention
    is the explicit one (local): torch 2.13's counter has no entry for the CPU flash kernel, it counts 0 there."""
    config = dataclasses.replace(NO_DROPOUT, seq_length=12, max_position_embeddings=12, recompute_activations=recompute,
                                 untie_embeddings_and_output_weights=untie, attention_backend="local",
                                 cross_entropy_chunk_size=chunk)
    counted = run_ranks(1, _counted_flops, config, 3, 12)[0]
    assert counted == pytest.approx(config.flops_per_token(micro_batch_size=3) * 3 * 12, rel=1e-12)


def _counted_layer_flops(config, b, s, h):
    layer = transformer_layer(config, init_parallel(1).tp, None)  # explicit matmuls: counted, unlike CPU flash
    name_parameters(layer, seed=0)
    materialize_module(layer)  # a layer built alone holds meta parameters until it is made
    x = torch.randn(b, s, h, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        layer(x).sum().backward()
    return counter.get_total_flops()


def test_one_layer_is_24h2_plus_4sh_per_token_and_pass():
    h, s, b = 32, 12, 3
    local = dataclasses.replace(NO_DROPOUT, attention_backend="local")
    assert run_ranks(1, _counted_layer_flops, local, b, s, h)[0] == 3 * (24 * h * h + 4 * s * h) * b * s


def test_flops_formula_is_megatrons():
    gpt2 = GPTConfig(num_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=50257,
                     max_position_embeddings=1024, cross_entropy_chunk_size=0)  # the logits path, computed once
    l, h, s, v = 12, 768, 1024, 50304  # Megatron pads the vocabulary to a multiple of 128
    megatron = 72 * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    assert gpt2.flops_per_token() == pytest.approx(megatron, rel=1e-12)
    assert dataclasses.replace(gpt2, recompute_granularity="full").flops_per_token() == pytest.approx(
        96 * l * h * h * (1 + s / (6 * h) + v / (16 * l * h)), rel=1e-12)
    # --recompute-activations is Megatron's selective recomputation: the two core-attention matmuls once more,
    # 4sh per token and layer (as FlopCounterMode counts them in test_flops_per_token_equals_the_counted_matmuls)
    assert dataclasses.replace(gpt2, recompute_activations=True).flops_per_token() == pytest.approx(
        72 * l * h * h * (1 + s / (6 * h) + v / (12 * l * h)) + 4 * l * s * h, rel=1e-12)
    # the chunked cross entropy computes the logits once more in backward for the tokens outside the last chunk:
    # none in one chunk (a sequence of 1024 in chunks of 2048), half of them for 4 sequences (2hV x 1/2 per token)
    chunked = dataclasses.replace(gpt2, cross_entropy_chunk_size=2048)
    assert chunked.flops_per_token() == pytest.approx(megatron, rel=1e-12)
    assert chunked.flops_per_token(micro_batch_size=4) == pytest.approx(megatron + h * v, rel=1e-12)


@pytest.mark.parametrize("moe", [
    dict(num_experts=4, moe_ffn_hidden_size=16),
    dict(num_experts=4, moe_router_topk=3, moe_shared_expert_intermediate_size=24, moe_layer_freq=(0, 1),
         swiglu=True, add_bias_linear=False),
], ids=["gpt-top2", "swiglu-top3-shared-dense-first"])
def test_moe_flops_per_token_are_the_active_parameters(moe):
    """A mixture of experts counts its router (2hE), the k experts each token is routed to and the shared experts
    (Megatron's MoE terms): FlopCounterMode's count of the per-expert loop's matmuls, exactly (dropless: every
    token passes through k experts)."""
    config = dataclasses.replace(NO_DROPOUT, seq_length=12, max_position_embeddings=12, attention_backend="local",
                                 cross_entropy_chunk_size=0, **moe)
    counted = run_ranks(1, _counted_flops, config, 3, 12)[0]
    assert counted == pytest.approx(config.flops_per_token(micro_batch_size=3) * 3 * 12, rel=1e-12)
    h, f, k = 32, config.expert_ffn_size, config.moe_router_topk
    dense = dataclasses.replace(config, num_experts=None, moe_ffn_hidden_size=None, moe_router_topk=2,
                                moe_shared_expert_intermediate_size=None, moe_layer_freq=1)
    matrices = 3 if config.swiglu else 2
    moe_layers = 2 if moe.get("moe_layer_freq") is None else 1
    shared = 2 * h * (config.moe_shared_expert_intermediate_size or 0) * matrices
    per_layer = 2 * h * 4 + k * 2 * h * f * matrices + shared - 2 * h * config.ffn_size * matrices
    assert config.flops_per_token() == pytest.approx(dense.flops_per_token() + 3 * moe_layers * per_layer, rel=1e-12)
