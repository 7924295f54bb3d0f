"""The context-parallel attention (ring, all-gather, and the all-to-all over heads) matches one process's causal
attention, forward and every input gradient, in fp64 on forked gloo ranks; GQA's K/V go as they are. The reference
is torch's scaled_dot_product_attention on the whole sequence; each rank compares its own tokens' rows.
fp64: the blocks sum in another order than the reference, ~1e-15; fp32 would leave ~1e-6 of rounding."""

import math

import pytest
import torch
import torch.nn.functional as F

from mpzero.context_parallel import ZigzagChunks, context_attention, heads_to_sequence, sequence_to_heads
from mpzero.context_parallel import blocks
from mpzero.context_parallel.blocks import block_backward, block_forward, merge
from mpzero.parallel import init_parallel
from tests.distributed import run_ranks

B, HEADS, D, S = 2, 4, 8, 32


def _inputs(groups: int):
    torch.manual_seed(0)
    q = torch.randn(B, HEADS, S, D, dtype=torch.float64)
    k, v = (torch.randn(B, groups, S, D, dtype=torch.float64) for _ in range(2))
    grad = torch.randn(B, HEADS, S, D, dtype=torch.float64)
    return q, k, v, grad


def _reference(q, k, v, grad):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.size(1) != q.size(1))
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _errors(comm_type: str, cp: int, groups: int, tile_rows: int, kernel: str) -> list[float]:
    blocks.TILE_ROWS = tile_rows  # this forked rank's own module
    group = init_parallel(1, cp_size=cp).cp
    layout = ZigzagChunks(S, cp, group.rank)
    q, k, v, grad = _inputs(groups)
    expected = _reference(q, k, v, grad)
    mine = [layout.take(t, dim=2).requires_grad_() for t in (q, k, v)]
    if comm_type == "a2a":  # the QKV output's layout: [b, L, (groups: n query heads, k, v), d]
        n = HEADS // groups
        qkv = torch.cat([mine[0].unflatten(1, (groups, n)), mine[1].unsqueeze(2), mine[2].unsqueeze(2)], dim=2)
        full = heads_to_sequence(qkv.permute(0, 3, 1, 2, 4).flatten(2), group, layout)  # [b, s, W/cp]
        x = full.view(B, S, groups // cp, n + 2, D)
        q_ = x[:, :, :, :n].flatten(2, 3).transpose(1, 2)
        k_, v_ = x[:, :, :, n].transpose(1, 2), x[:, :, :, n + 1].transpose(1, 2)
        context = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=n > 1)
        out = sequence_to_heads(context.transpose(1, 2).flatten(2), group, layout).view(B, S // cp, HEADS, D)
        out = out.transpose(1, 2)
    else:
        out = context_attention(*mine, group, comm_type, 1 / math.sqrt(D), kernel)
    out.backward(layout.take(grad, dim=2))
    got = [out.detach()] + [t.grad for t in mine]
    return [(a - layout.take(e, dim=2)).abs().max().item() for a, e in zip(got, expected)]


CASES = [(comm, cp, groups, tile, kernel) for comm in ("p2p", "all_gather", "a2a")
         for cp, groups in ((2, 4), (2, 2), (4, 4), (4, 1)) for tile, kernel in ((1024, "local"), (3, "local"),
                                                                                 (1024, "flash"))
         if (comm != "a2a" or groups % cp == 0)  # a2a splits the key/value groups over CP
         and (comm != "a2a" or (tile, kernel) == (1024, "local"))]  # and runs the attention backend, not the blocks


# tile 3: several tiles of query rows per block, the last shorter; flash: the CPU's kernel per block
@pytest.mark.parametrize("comm_type,cp,groups,tile_rows,kernel", CASES)
def test_context_attention_matches_one_process_in_fp64(comm_type, cp, groups, tile_rows, kernel):
    for errors in run_ranks(cp, _errors, comm_type, cp, groups, tile_rows, kernel):
        assert max(errors) < 1e-12, errors


def test_blocks_merged_by_log_sum_exp_match_one_softmax(monkeypatch):
    """Two blocks of keys (the second causal, bottom-right aligned) merged = one softmax over the concatenation,
    against a reference written here; the block backward from the merged output = autograd's. Tiles of 3 query
    rows: the causal mask's diagonal follows each tile."""
    monkeypatch.setattr(blocks, "TILE_ROWS", 3)
    torch.manual_seed(1)
    q = torch.randn(1, 2, 3, 4, 5, dtype=torch.float64)  # [b, g, n, sq, d]: two tiles of query rows
    k, v = (torch.randn(1, 2, 9, 5, dtype=torch.float64) for _ in range(2))
    out, lse = block_forward(q, k[:, :, :5], v[:, :, :5], 0.5, causal=False)
    part, part_lse = block_forward(q, k[:, :, 5:], v[:, :, 5:], 0.5, causal=True)
    merge(out, lse, slice(None), part, part_lse)
    scores = torch.einsum("bgnqd,bgkd->bgnqk", q, k) * 0.5
    visible = torch.arange(9)[None, :] <= torch.arange(4)[:, None] + 5  # query i sees keys 0..5+i
    scores = scores.masked_fill(~visible, float("-inf"))
    expected = torch.einsum("bgnqk,bgkd->bgnqd", scores.softmax(-1), v)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-14)
    torch.testing.assert_close(lse, scores.logsumexp(-1), rtol=0, atol=1e-14)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(expected)
    torch.einsum("bgnqk,bgkd->bgnqd", (torch.einsum("bgnqd,bgkd->bgnqk", qr, kr) * 0.5).masked_fill(
        ~visible, float("-inf")).softmax(-1), vr).backward(dout)
    delta = (dout * out).sum(-1)
    dq1, dk1, dv1 = block_backward(q, k[:, :, :5], v[:, :, :5], lse, dout, delta, 0.5, causal=False)
    dq2, dk2, dv2 = block_backward(q, k[:, :, 5:], v[:, :, 5:], lse, dout, delta, 0.5, causal=True)
    torch.testing.assert_close(dq1 + dq2, qr.grad, rtol=0, atol=1e-13)
    torch.testing.assert_close(torch.cat([dk1, dk2], 2), kr.grad, rtol=0, atol=1e-13)
    torch.testing.assert_close(torch.cat([dv1, dv2], 2), vr.grad, rtol=0, atol=1e-13)
