"""The GPT model: TP=2 equals TP=1 (logits, loss, every gradient), recomputation equals storing
activations, vocabulary padding never changes the loss, dropout streams behave under TP.
fp32 tolerance 1e-5 relative: TP changes only the order of floating-point sums."""

import torch

from mpzero.errors import ConfigError
from mpzero.models import GPTConfig, GPTModel
from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import gather_from_tp, gather_full, seed_everything
from tests.distributed import run_ranks

TOL = dict(rtol=1e-5, atol=1e-6)
CONFIG = GPTConfig(num_layers=2, hidden_size=24, num_attention_heads=4, vocab_size=203,
                   max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0, attention_backend="local")


def _tokens(seed=1, batch=2, seq=9):
    return torch.randint(0, CONFIG.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))


def _run_model(tp_size, config=CONFIG, seed=1234):
    """Loss, full logits and full gradients keyed by parameter name, identical on every TP rank."""
    groups = init_parallel(tp_size)
    rng = seed_everything(seed, groups.tp_rank, groups.device)
    model = GPTModel(config, groups.tp, rng)
    tokens = _tokens()
    logits = gather_from_tp(model(tokens[:, :-1]), groups.tp)[..., :config.vocab_size]
    loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
    loss.backward()
    grads = {name: gather_full(p.grad, p.partition_dim, groups.tp) for name, p in model.named_parameters()}
    return loss.item(), logits.detach(), grads


def _assert_same_model_outputs(a, b):
    assert abs(a[0] - b[0]) <= 1e-5 * abs(b[0])
    torch.testing.assert_close(a[1], b[1], **TOL)
    assert a[2].keys() == b[2].keys()
    for name in b[2]:
        full_a, full_b = a[2][name], b[2][name]
        if name.endswith("word_embeddings.weight"):  # padded to 128*tp rows: compare the real vocabulary
            full_a, full_b = full_a[:CONFIG.vocab_size], full_b[:CONFIG.vocab_size]
        torch.testing.assert_close(full_a, full_b, **TOL, msg=lambda m: f"{name}: {m}")


def test_gpt_at_tp2_matches_tp1():
    single = run_ranks(1, _run_model, 1)[0]
    for rank_result in run_ranks(2, _run_model, 2):
        _assert_same_model_outputs(rank_result, single)


def test_gpt_at_tp4_matches_tp1():
    single = run_ranks(1, _run_model, 1)[0]
    _assert_same_model_outputs(run_ranks(4, _run_model, 4)[3], single)


def test_vocab_padding_does_not_change_loss():
    unpadded = GPTConfig(**{**CONFIG.__dict__, "make_vocab_size_divisible_by": 1})
    padded_result = run_ranks(1, _run_model, 1)[0]
    unpadded_result = run_ranks(1, _run_model, 1, unpadded)[0]
    assert CONFIG.padded_vocab_size(1) == 256 and unpadded.padded_vocab_size(1) == 203
    _assert_same_model_outputs(padded_result, unpadded_result)


def _grads_with_dropout(tp_size, recompute):
    config = GPTConfig(**{**CONFIG.__dict__, "hidden_dropout": 0.2, "attention_dropout": 0.3,
                          "recompute_activations": recompute})
    groups = init_parallel(tp_size)
    model = GPTModel(config, groups.tp, seed_everything(7, groups.tp_rank, groups.device))
    tokens = _tokens()
    model(tokens[:, :-1], tokens[:, 1:]).mean().backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_recomputation_matches_stored_activations_with_dropout():
    for stored, recomputed in zip(run_ranks(2, _grads_with_dropout, 2, False),
                                  run_ranks(2, _grads_with_dropout, 2, True)):
        for name, grad in stored.items():
            torch.testing.assert_close(recomputed[name], grad, rtol=0, atol=0, msg=name)


def _dropout_masks():
    groups = init_parallel(2)
    rng = seed_everything(5, groups.tp_rank, groups.device)
    replicated = torch.nn.functional.dropout(torch.ones(64), 0.5)
    with rng.fork():
        sharded = torch.nn.functional.dropout(torch.ones(64), 0.5)
    return replicated, sharded


def test_dropout_differs_across_tp_ranks_only_inside_tp_regions():
    (rep0, shard0), (rep1, shard1) = run_ranks(2, _dropout_masks)
    assert torch.equal(rep0, rep1)
    assert not torch.equal(shard0, shard1)


def test_bad_shapes_are_one_line_errors():
    import pytest
    with pytest.raises(ConfigError, match="--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 8"):
        CONFIG.validate(8)
    bad = GPTConfig(**{**CONFIG.__dict__, "hidden_size": 26})
    with pytest.raises(ConfigError, match="--hidden-size 26 is not divisible by --num-attention-heads 4"):
        bad.validate(1)


def test_flash_attention_matches_core_attention():
    """SDPA and the explicit path differ only in summation order (fp32: 1e-5)."""
    flash = GPTConfig(**{**CONFIG.__dict__, "attention_backend": "auto", "use_flash_attn": True})
    _assert_same_model_outputs(run_ranks(2, _run_model, 2, flash)[1], run_ranks(1, _run_model, 1)[0])


def _flash_dropout_grads(recompute):
    groups = init_parallel(1)
    config = GPTConfig(**{**CONFIG.__dict__, "attention_dropout": 0.3, "attention_backend": "flash",
                          "recompute_activations": recompute})
    model = GPTModel(config, groups.tp, seed_everything(7, 0, groups.device))
    tokens = _tokens()
    model(tokens[:, :-1], tokens[:, 1:]).mean().backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_recomputation_replays_flash_attention_dropout():
    stored, recomputed = run_ranks(1, _flash_dropout_grads, False)[0], run_ranks(1, _flash_dropout_grads, True)[0]
    for name, grad in stored.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=0, atol=0, msg=name)
