"""The router's arithmetic (mpzero/moe/routing.py) against references written here from the formulas, token by
token in plain Python: the top-k choice and gates (softmax after or before the choice, sigmoid normalised over the
chosen, the expert bias steering the choice alone, group-limited choice), the capacity drop by gate and by position,
the Switch load-balancing loss E sum_i f_i P_i with Megatron's scaling, the per-sequence loss and the z-loss."""

import math

import pytest
import torch

from mpzero.moe import (aux_loss_scores, capacity, drop_to_capacity, routed_counts, seq_aux_loss, switch_aux_loss,
                        top_k, z_loss)

T, E = 24, 8


def _logits(seed=0, tokens=T, experts=E):
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _best(values: list[float], k: int) -> list[int]:
    return sorted(range(len(values)), key=lambda i: -values[i])[:k]


def _reference_top_k(row: list[float], k: int, score: str, pre_softmax: bool, bias=None, groups=None):
    """(gates, experts) of one token, from the definitions."""
    allowed = list(range(len(row)))
    if score == "softmax":
        exps = [math.exp(v) for v in row]
        scores = [e / sum(exps) for e in exps] if pre_softmax else row
    else:
        scores = [1 / (1 + math.exp(-v)) for v in row]
    choice = [s + (bias[i] if bias is not None else 0.0) for i, s in enumerate(scores)]
    if groups is not None:  # (groups, groups used): each group scored by the sum of its best k / used
        num_groups, used = groups
        size = len(row) // num_groups
        group_scores = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:k // used])
                        for g in range(num_groups)]
        allowed = [i for g in _best(group_scores, used) for i in range(g * size, (g + 1) * size)]
    chosen = sorted(allowed, key=lambda i: -choice[i])[:k]
    if score == "softmax" and not pre_softmax:
        exps = [math.exp(row[i]) for i in chosen]
        return [e / sum(exps) for e in exps], chosen
    gates = [scores[i] for i in chosen]
    if score == "sigmoid" and k > 1:
        gates = [g / sum(gates) for g in gates]
    return gates, chosen


@pytest.mark.parametrize("k,score,pre_softmax,groups,bias", [
    (2, "softmax", False, None, False), (1, "softmax", True, None, False), (3, "softmax", True, None, False),
    (2, "sigmoid", False, None, False), (1, "sigmoid", False, None, False), (4, "sigmoid", False, None, True),
    (4, "softmax", False, (4, 2), False), (4, "sigmoid", False, (4, 2), True),
], ids=["softmax-top2", "pre-softmax-top1", "pre-softmax-top3", "sigmoid-top2", "sigmoid-top1", "sigmoid-bias",
        "groups-softmax", "groups-sigmoid-bias"])
def test_top_k_matches_the_definitions(k, score, pre_softmax, groups, bias):
    logits = _logits()
    expert_bias = torch.linspace(-0.3, 0.3, E, dtype=torch.float64) if bias else None
    probs, indices = top_k(logits, k, score, pre_softmax, *(groups or (None, None)), expert_bias)
    for t in range(T):
        gates, chosen = _reference_top_k(logits[t].tolist(), k, score, pre_softmax,
                                         expert_bias.tolist() if bias else None, groups)
        order = sorted(range(k), key=lambda j: chosen[j])
        got = sorted(range(k), key=lambda j: int(indices[t, j]))
        assert [int(indices[t, j]) for j in got] == [chosen[j] for j in order]
        assert [float(probs[t, j]) for j in got] == pytest.approx([gates[j] for j in order], rel=1e-12)


@pytest.mark.parametrize("k,score,pre_softmax,bias", [(2, "softmax", False, False), (3, "softmax", True, False),
                                                      (4, "sigmoid", False, True), (1, "sigmoid", False, False)],
                         ids=["softmax-top2", "pre-softmax-top3", "sigmoid-bias-top4", "sigmoid-top1"])
def test_the_topk_scaling_factor_multiplies_the_normalised_gates(k, score, pre_softmax, bias):
    """Megatron's --moe-router-topk-scaling-factor (DeepSeek-V3's routed_scaling_factor 2.5): each gate, after its
    normalisation, times the factor, whatever the score function; the choice is unchanged."""
    logits = _logits(2)
    expert_bias = torch.linspace(-0.3, 0.3, E, dtype=torch.float64) if bias else None
    probs, indices = top_k(logits, k, score, pre_softmax, None, None, expert_bias, scaling_factor=2.5)
    for t in range(T):
        gates, chosen = _reference_top_k(logits[t].tolist(), k, score, pre_softmax,
                                         expert_bias.tolist() if bias else None)
        order = sorted(range(k), key=lambda j: chosen[j])
        got = sorted(range(k), key=lambda j: int(indices[t, j]))
        assert [int(indices[t, j]) for j in got] == [chosen[j] for j in order]
        assert [float(probs[t, j]) for j in got] == pytest.approx([2.5 * gates[j] for j in order], rel=1e-12)


def test_the_expert_bias_steers_the_choice_not_the_gates():
    logits = _logits(1)
    bias = torch.zeros(E, dtype=torch.float64)
    bias[3] = 100.0  # expert 3 is everyone's first choice, its gate still its own sigmoid's share
    probs, indices = top_k(logits, 2, "sigmoid", expert_bias=bias)
    assert (indices == 3).any(dim=1).all()
    scores = torch.sigmoid(logits).gather(1, indices)
    torch.testing.assert_close(probs, scores / scores.sum(1, keepdim=True))


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.5])
def test_capacity_drop_keeps_each_experts_best_or_first_tokens(policy, factor):
    logits = _logits(2)
    probs, indices = top_k(logits, 2, "softmax")
    routing = drop_to_capacity(probs, indices, E, factor, policy)
    cap = math.ceil(T * 2 / E * factor)
    assert cap == capacity(T, 2, E, factor)
    for e in range(E):
        routed = [(t, j) for t in range(T) for j in range(2) if int(indices[t, j]) == e]
        if policy == "probs":
            routed.sort(key=lambda slot: -float(probs[slot]))
        kept = set(routed[:cap])
        for t, j in routed:
            assert bool(routing.kept[t, j]) == ((t, j) in kept)
            assert float(routing.probs[t, j]) == (float(probs[t, j]) if (t, j) in kept else 0.0)


def test_dropless_keeps_every_slot():
    probs, indices = top_k(_logits(3), 2, "softmax")
    routing = drop_to_capacity(probs, indices, E, None)
    assert routing.kept.all() and torch.equal(routing.probs, probs)


@pytest.mark.parametrize("score,k", [("softmax", 2), ("sigmoid", 3), ("softmax", 1)])
def test_switch_aux_loss_is_E_sum_f_P_times_coeff(score, k):
    """Switch Transformer's E sum_i f_i P_i, f_i = c_i / (T k), P_i = mean_t p_ti (Megatron's 1/k in f)."""
    logits, coeff = _logits(4), 0.01
    scores = aux_loss_scores(logits, score)
    rows = [[1 / (1 + math.exp(-v)) for v in row] for row in logits.tolist()] if score == "sigmoid" else [
        [math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in logits.tolist()]
    rows = [[v / sum(row) for v in row] for row in rows]  # sigmoid normalised over all experts (softmax: no-op)
    counts = [0] * E
    for row in rows:
        for i in _best(row, k):
            counts[i] += 1
    f = [c / (T * k) for c in counts]
    p = [sum(row[i] for row in rows) / T for i in range(E)]
    expected = coeff * E * sum(fi * pi for fi, pi in zip(f, p))
    assert routed_counts(scores, k).tolist() == counts
    assert float(switch_aux_loss(scores, routed_counts(scores, k), T, k, coeff)) == pytest.approx(expected, rel=1e-12)


def test_switch_aux_loss_of_ranks_parts_sums_to_the_whole():
    """Global counts and each rank's scores (sequence parallel): the parts add up to one process's loss."""
    scores = aux_loss_scores(_logits(5), "softmax")
    counts = routed_counts(scores, 2)
    whole = switch_aux_loss(scores, counts, T, 2, 0.1)
    parts = sum(switch_aux_loss(part, counts, T, 2, 0.1) for part in scores.chunk(3))
    assert float(parts) == pytest.approx(float(whole), rel=1e-12)


def test_seq_aux_loss_is_the_mean_of_each_sequences_switch_loss():
    s, b, k, coeff = 6, 4, 2, 0.01
    scores = aux_loss_scores(_logits(6, s * b), "softmax").view(s, b, E)  # sequence-major tokens
    counts = torch.stack([routed_counts(scores[:, j], k) for j in range(b)])
    per_sequence = [float(switch_aux_loss(scores[:, j], counts[j], s, k, coeff)) for j in range(b)]
    got = seq_aux_loss(scores, counts, s, b, k, coeff)
    assert float(got) == pytest.approx(sum(per_sequence) / b, rel=1e-12)


def test_z_loss_is_coeff_times_mean_squared_logsumexp():
    logits = _logits(7)
    expected = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / T * 1e-3
    assert float(z_loss(logits, 1e-3)) == pytest.approx(expected, rel=1e-12)
