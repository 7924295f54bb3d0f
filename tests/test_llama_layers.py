"""The LLaMA family's layers, each against a reference written here from its formula (not the project's code):
RoPE (rotate-half pairs (i, i + d/2), HF's convention), SwiGLU with its fused [gate; up] weight split so each TP
rank holds matching halves, grouped-query attention with heads and K/V groups split over TP 2 on every backend,
and the whole model at TP 2 equal to TP 1 (logits and every gradient). fp32 tolerances 1e-5 relative where the
order of sums differs (TP, float64 references)."""

import math

import pytest
import torch

from mpzero.deferred_init import materialize_module, name_parameters
from mpzero.models import GPTConfig, GPTModel
from mpzero.models.attention import AttentionConfig, SelfAttention
from mpzero.models.blocks import MLP
from mpzero.models.rotary import RotaryEmbedding, rope_cos_sin
from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import gather_from_tp, gather_full
from tests.distributed import run_ranks

TOL = dict(rtol=1e-5, atol=1e-6)
LLAMA = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=203, max_position_embeddings=16,
                  hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm", layernorm_epsilon=1e-6,
                  swiglu=True, ffn_hidden_size=48, position_embedding_type="rope", group_query_attention=True,
                  num_query_groups=2, add_bias_linear=False, untie_embeddings_and_output_weights=True)


def _rope_formula(x: torch.Tensor, positions: torch.Tensor, rot_dim: int, base: float) -> torch.Tensor:
    """x [..., s, d]: feature i < rot_dim/2 pairs with i + rot_dim/2, rotated by t * base^(-2i/rot_dim)."""
    x = x.double()
    out = x.clone()
    half = rot_dim // 2
    for i in range(half):
        angle = positions.double() * base ** (-2 * i / rot_dim)  # [s]
        c, s = torch.cos(angle)[:, None], torch.sin(angle)[:, None]
        a, b = x[..., i:i + 1], x[..., i + half:i + half + 1]
        out[..., i:i + 1] = a * c - b * s
        out[..., i + half:i + half + 1] = b * c + a * s
    return out.float()


@pytest.mark.parametrize("rot_dim", [8, 4])  # whole head, and --rotary-percent 0.5 (the rest passes through)
def test_rope_matches_the_rotation_formula(rot_dim):
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 3, 10, 8, generator=g), torch.randn(2, 1, 10, 8, generator=g)
    rope = RotaryEmbedding(16, rot_dim, 500000.0)
    for start in (0, 5):  # a cache offset gives positions start..start+9
        q_rot, k_rot = rope.rotate(q, k, start)
        positions = torch.arange(start, start + 10)
        torch.testing.assert_close(q_rot, _rope_formula(q, positions, rot_dim, 500000.0), **TOL)
        torch.testing.assert_close(k_rot, _rope_formula(k, positions, rot_dim, 500000.0), **TOL)


def test_rope_backward_matches_autograd_of_the_formula():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64)
    rope = RotaryEmbedding(8, 4, 10000.0)
    cos, sin = rope.cos[:6].double(), rope.sin[:6].double()
    from mpzero.models.rotary import apply_rotary
    (apply_rotary(x, cos, sin) * dy).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    expected = torch.cat((x_ref[..., :2] * cos[:, :2] - x_ref[..., 2:4] * sin[:, :2],
                          x_ref[..., 2:4] * cos[:, 2:] + x_ref[..., :2] * sin[:, 2:], x_ref[..., 4:]), dim=-1)
    (expected * dy).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)  # float64: rounding only


def test_rope_scores_depend_only_on_the_distance():
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, 1, 1, 16, generator=g), torch.randn(1, 1, 1, 16, generator=g)
    rope = RotaryEmbedding(32, 16, 10000.0)
    scores = [(rope.rotate(q, k, m)[0] * rope.rotate(k, k, n)[1]).sum().item() for m, n in ((3, 1), (12, 10), (30, 28))]
    assert max(scores) - min(scores) < 1e-5
    cos, sin = rope_cos_sin(32, 16, 10000.0)
    assert cos.dtype == sin.dtype == torch.float32  # fp32 tables whatever the model's dtype


def _swiglu(tp_size):
    groups = init_parallel(tp_size)
    mlp = _made(MLP(LLAMA.hidden_size, LLAMA.ffn_size, groups.tp, _draw(1), _draw(2), activation=torch.nn.functional.silu,
                    gated=True, bias=False))
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(5), requires_grad=True)
    y = mlp(x)
    y.square().sum().backward()
    return (y.detach(), x.grad, mlp.fc1.weight.detach(), gather_full(mlp.fc1.weight.grad, 0, groups.tp, chunks=2),
            gather_full(mlp.fc2.weight.grad, 1, groups.tp))


def _draw(seed):
    """An init that ignores the parameter's own generator: the test draws the same weights itself."""
    return lambda full, generator=None: torch.nn.init.normal_(full, std=0.02,
                                                              generator=torch.Generator().manual_seed(seed))


def _made(module):
    """A block built alone holds parameters without storage until it is made (`mpzero.deferred_init`)."""
    name_parameters(module, seed=0)
    materialize_module(module)
    return module


def test_swiglu_matches_the_formula_and_each_rank_holds_matching_gate_up_halves():
    f, h = 48, 32
    w1, w2 = torch.empty(2 * f, h), torch.empty(h, f)
    _draw(1)(w1)
    _draw(2)(w2)
    gate, up = w1[:f], w1[f:]  # the global layout: [gate; up]
    x = torch.randn(2, 5, h, generator=torch.Generator().manual_seed(5), requires_grad=True)
    a, b = x @ gate.t(), x @ up.t()
    y_ref = (a * torch.sigmoid(a) * b) @ w2.t()  # down(silu(gate x) * up x), silu(a) = a sigmoid(a)
    for rank, (y, _, local, _, _) in enumerate(run_ranks(2, _swiglu, 2)):
        torch.testing.assert_close(y, y_ref, **TOL)
        half = f // 2
        assert torch.equal(local, torch.cat([gate[rank * half:(rank + 1) * half], up[rank * half:(rank + 1) * half]]))
    one, two = run_ranks(1, _swiglu, 1)[0], run_ranks(2, _swiglu, 2)[0]
    for got, want in zip(two[:2] + two[3:], one[:2] + one[3:]):
        torch.testing.assert_close(got, want, **TOL)


def _attention_formula(x, w_qkv, w_dense, heads, groups, rot_dim, base):
    """Causal GQA from the formulas: rows per group are [its heads/groups query heads; k; v] (head size d);
    query head i reads K/V group i // (heads / groups); scores q k^T / sqrt(d); RoPE on q and k."""
    b, s, h = x.shape
    d, per = h // heads, heads // groups
    rows = (x @ w_qkv.t()).view(b, s, groups, per + 2, d)
    positions = torch.arange(s)
    outs = []
    for i in range(heads):
        g, j = divmod(i, per)
        q = _rope_formula(rows[:, :, g, j], positions, rot_dim, base)
        k = _rope_formula(rows[:, :, g, per], positions, rot_dim, base)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(scores.softmax(-1) @ rows[:, :, g, per + 1])
    return torch.cat(outs, dim=-1) @ w_dense.t()


def _attention(tp_size, backend):
    groups = init_parallel(tp_size)
    config = AttentionConfig(LLAMA.hidden_size, LLAMA.num_attention_heads, LLAMA.query_groups, bias=False,
                             backend=backend)
    rotary = RotaryEmbedding(16, LLAMA.rotary_dim, LLAMA.rotary_base)
    attention = _made(SelfAttention(config, groups.tp, _draw(1), _draw(2), rotary=rotary))
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(8))
    return (attention(x).detach(), gather_full(attention.qkv.weight.detach(), 0, groups.tp),
            gather_full(attention.dense.weight.detach(), 1, groups.tp), x)


@pytest.mark.parametrize("backend", ["local", "unfused", "flash"])
def test_grouped_query_attention_at_tp2_matches_the_formula(backend):
    for y, w_qkv, w_dense, x in run_ranks(2, _attention, 2, backend):
        torch.testing.assert_close(y, _attention_formula(x, w_qkv, w_dense, 4, 2, 8, 10000.0), **TOL)


def _model(tp_size, config):
    groups = init_parallel(tp_size)
    model = GPTModel(config, groups.tp)
    tokens = torch.randint(0, config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    logits = gather_from_tp(model(tokens[:, :-1]), groups.tp)[..., :config.vocab_size]
    model(tokens[:, :-1], tokens[:, 1:], reduction="mean").backward()
    return logits.detach(), {n: gather_full(p.grad, p.partition_dim, groups.tp, p.partition_chunks)
                             for n, p in model.named_parameters()}


@pytest.mark.parametrize("change", [{}, {"sequence_parallel": True}, {"rotary_percent": 0.5, "add_bias_linear": True},
                                    {"position_embedding_type": "none", "group_query_attention": False,
                                     "num_query_groups": None}], ids=["plain", "sp", "partial-rope-bias", "no-pos"])
def test_llama_at_tp2_matches_tp1(change):
    config = GPTConfig(**{**LLAMA.__dict__, **change})
    logits, grads = run_ranks(1, _model, 1, GPTConfig(**{**config.__dict__, "sequence_parallel": False}))[0]
    for logits2, grads2 in run_ranks(2, _model, 2, config):
        torch.testing.assert_close(logits2, logits, **TOL)
        assert grads2.keys() == grads.keys()
        for name in grads:
            torch.testing.assert_close(grads2[name], grads[name], **TOL)


def _counted_flops(config, batch, seq):
    from torch.utils.flop_counter import FlopCounterMode
    from mpzero.tensor_parallel import seed_everything
    groups = init_parallel(1)
    model = GPTModel(config, groups.tp, seed_everything(1, groups.tp_rank, groups.device))
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(2))
    with FlopCounterMode(display=False) as counter:
        model(tokens[:, :-1], tokens[:, 1:], reduction="mean").backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("change", [{}, {"recompute_activations": True}, {"attention_backend": "unfused"},
                                    {"group_query_attention": False, "num_query_groups": None}])
def test_flops_per_token_equals_the_counted_matmuls(change):
    """QKV 2h(h + 2gd), SwiGLU's three matrices: the formula against every matmul FlopCounterMode counts (the
    explicit attention paths: torch 2.13's counter has no entry for the CPU flash kernel, it counts 0 there)."""
    config = GPTConfig(**{**LLAMA.__dict__, "seq_length": 12, "max_position_embeddings": 12,
                          "attention_backend": "local", **change})
    assert run_ranks(1, _counted_flops, config, 3, 12)[0] == config.flops_per_token() * 3 * 12


def test_rope_tables_follow_the_activations_device():
    rope = RotaryEmbedding(16, 8, 500000.0)
    assert "cos" not in rope.state_dict()  # non-persistent: never in checkpoints
    cos, sin = rope_cos_sin(16, 8, 500000.0)
    assert torch.equal(rope.cos, cos) and torch.equal(rope.sin, sin)
    q = torch.empty(1, 2, 4, 8, device="meta")  # a model whose parameters ZeRO made on another device
    rope.rotate(q, q)
    assert rope.cos.is_meta and rope.sin.is_meta
