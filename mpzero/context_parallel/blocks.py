"""Attention of a block of queries over a block of keys, with the log-sum-exp of each query's scores, and its
backward from the final output and log-sum-exp (FlashAttention's maths, written with torch ops): the pieces the
ring and all-gather context-parallel attentions (`ring.py`, `gather.py`) are built from.

Per block, for a query row with scores S = q k^T / sqrt(d) over the block's keys (masked ones -inf):
    lse = log sum_j exp(S_j),  out = sum_j exp(S_j - lse) v_j
Blocks over disjoint keys merge exactly: lse = log(exp(lse_1) + exp(lse_2)) and
out = exp(lse_1 - lse) out_1 + exp(lse_2 - lse) out_2 (`merge`). The backward of a block, given the merged output O,
its lse and the output gradient dO, with D = rowsum(dO * O) and P = exp(S - lse):
    dV = P^T dO,   dS = P * (dO V^T - D) / sqrt(d),   dQ = dS K,   dK = dS^T Q
summed over blocks. Nothing [s, s] outlives a block: only q, k, v, the output and the lse are kept for backward.
Scores, statistics and partial outputs are fp32; the matmuls run in the inputs' dtype.

Each block is computed `TILE_ROWS` query rows at a time (the statistics are per row), so its working tensors are
[b, g, n, TILE_ROWS, keys] however long the chunks. Shapes: queries grouped by their key/value head
(grouped-query attention without repeating K and V), q
[b, g, n, sq, d] for g key/value heads serving n query heads each; k, v [b, g, sk, d].

`schedule(rank, size)`: which block each step of the load-balanced ring computes (TransformerEngine's
`AttnFuncWithCPAndKVP2P`): step 0 the rank's own chunks, causal; step i <= rank (keys of an earlier rank j = rank - i)
every query over the first half of the keys; step i > rank only the second half of the queries, over all keys.
Every step after the first is half a block: the ranks stay balanced.
"""

from __future__ import annotations

import torch

OWN, FIRST_KEYS, LAST_QUERIES = "own", "first keys", "last queries"


def schedule(rank: int, size: int) -> list[tuple[int, str]]:
    """(source CP rank of the keys and values, block kind) of each ring step, in order."""
    steps = [(rank, OWN)]
    for i in range(1, size):
        source = (rank - i) % size
        steps.append((source, FIRST_KEYS if source < rank else LAST_QUERIES))
    return steps


def block_slices(kind: str, local_length: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) of a block of `kind` over local chunks of `local_length` tokens."""
    c, every = local_length // 2, slice(None)
    if kind == OWN:  # the two local chunks are in order: the plain causal mask is the global one
        return every, every, True
    if kind == FIRST_KEYS:  # an earlier rank's first chunk precedes both of ours; its second follows both
        return every, slice(0, c), False
    return slice(c, None), every, False  # a later rank: both its chunks precede our second, follow our first


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for the scores, statistics and sums of 16- and 32-bit inputs; fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


TILE_ROWS = 1024  # query rows scored at once: a block's working tensors are [b, g, n, TILE_ROWS, keys] fp32


def _tiles(rows: int) -> list[slice]:
    return [slice(first, min(first + TILE_ROWS, rows)) for first in range(0, rows, TILE_ROWS)]


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, rows: slice, sq: int) -> torch.Tensor:
    """fp32 [b, g, n, tile, sk] scaled scores of the query rows `rows` of a block of `sq`; causal: query i sees
    keys j <= i + sk - sq (bottom-right aligned)."""
    b, g, n, _, d = q.shape
    tile, sk = rows.stop - rows.start, k.size(2)
    scores = torch.matmul(q[..., rows, :].reshape(b, g, n * tile, d), k.transpose(-1, -2)).view(b, g, n, tile, sk)
    scores = scores.to(statistics_dtype(q.dtype)) * scale
    if causal:
        future = torch.ones(tile, sk, dtype=torch.bool, device=q.device).triu_(sk - sq + 1 + rows.start)
        scores.masked_fill_(future, float("-inf"))
    return scores


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out fp32 [b, g, n, sq, d], lse fp32 [b, g, n, sq]) of the queries over this block's keys, `TILE_ROWS`
    query rows at a time."""
    b, g, n, sq, _ = q.shape
    wide = statistics_dtype(q.dtype)
    out = torch.empty(b, g, n, sq, v.size(-1), dtype=wide, device=q.device)
    lse = torch.empty(b, g, n, sq, dtype=wide, device=q.device)
    for rows in _tiles(sq):
        scores = _scores(q, k, scale, causal, rows, sq)
        tile_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores.sub_(tile_lse.unsqueeze(-1)))
        tile = rows.stop - rows.start
        out[..., rows, :] = torch.matmul(probs.to(v.dtype).view(b, g, n * tile, -1), v).view(b, g, n, tile, -1)
        lse[..., rows] = tile_lse
    return out, lse


def merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold a block's (part, part_lse) for query rows `rows` into the running (out, lse), in place."""
    old = lse[..., rows]
    new = torch.logaddexp(old, part_lse)
    out[..., rows, :] = (out[..., rows, :] * torch.exp(old - new).unsqueeze(-1)
                         + part * torch.exp(part_lse - new).unsqueeze(-1))
    lse[..., rows] = new


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                   delta: torch.Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, ...]:
    """(dq [b, g, n, sq, d], dk, dv [b, g, sk, d]), fp32, of this block's part of the attention; `lse` and
    `delta` (rowsum(dO * O)) are the merged ones of these query rows, `dout` their output gradient."""
    b, g, n, sq, d = q.shape
    dtype, wide = q.dtype, lse.dtype
    dq = torch.empty(q.shape, dtype=wide, device=q.device)
    dk = torch.zeros(k.shape, dtype=wide, device=k.device)
    dv = torch.zeros(v.shape, dtype=wide, device=v.device)
    for rows in _tiles(sq):
        tile = rows.stop - rows.start
        probs = torch.exp(_scores(q, k, scale, causal, rows, sq).sub_(lse[..., rows].unsqueeze(-1)))
        dout_flat = dout[..., rows, :].reshape(b, g, n * tile, d).to(dtype)
        dv += torch.matmul(probs.view(b, g, n * tile, -1).to(dtype).transpose(-1, -2), dout_flat).to(wide)
        dprobs = torch.matmul(dout_flat, v.transpose(-1, -2)).view(b, g, n, tile, -1).to(wide)
        dscores = probs.mul_(dprobs.sub_(delta[..., rows].unsqueeze(-1))).mul_(scale)
        dscores = dscores.view(b, g, n * tile, -1).to(dtype)
        dq[..., rows, :] = torch.matmul(dscores, k).view(b, g, n, tile, d)
        dk += torch.matmul(dscores.transpose(-1, -2), q[..., rows, :].reshape(b, g, n * tile, d)).to(wide)
    return dq, dk, dv


def forward_blocks(q: torch.Tensor, kv_stream, steps: list[tuple[int, str]], scale: float,
                   forward=block_forward) -> tuple[torch.Tensor, torch.Tensor]:
    """(out fp32, lse fp32) of the local queries q [b, g, n, L, d] over the keys and values `kv_stream` yields
    ([2, b, g, L, d]: k and v of each step's source rank, in `steps` order), merged block by block; `forward`
    computes a block (`block_forward`, or a kernel's: `kernels.py`)."""
    out = lse = None
    stream = iter(kv_stream)
    for _, kind in steps:
        kv = next(stream)  # not zip's: its reused result tuple would hold the previous K/V while the next is posted
        rows, keys, causal = block_slices(kind, q.size(3))
        part, part_lse = forward(q[..., rows, :], kv[0][:, :, keys], kv[1][:, :, keys], scale, causal)
        if out is None:  # the first step (the own chunks) covers every query row
            out, lse = part, part_lse
        else:
            merge(out, lse, rows, part, part_lse)
        del kv  # before the stream posts the next exchange: only the K/V in use and in flight are held
    return out, lse


def backward_blocks(q: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, out: torch.Tensor, kv_stream,
                    steps: list[tuple[int, str]], scale: float, dkv_sink, backward) -> torch.Tensor:
    """dq fp32 [b, g, n, L, d]; each step's dk and dv ([2, b, g, L, d] fp32, zero outside the block's keys) go to
    `dkv_sink.add(source, dkv)`, which sums them on the rank that holds those keys. `backward(q, k, v, lse, dout,
    out, scale, causal)` computes a block's gradients from the merged `out` and `lse` (`kernels.py`)."""
    dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
    stream = iter(kv_stream)
    for source, kind in steps:
        kv = next(stream)
        rows, keys, causal = block_slices(kind, q.size(3))
        dq_part, dk, dv = backward(q[..., rows, :], kv[0][:, :, keys], kv[1][:, :, keys], lse[..., rows],
                                   dout[..., rows, :], out[..., rows, :], scale, causal)
        dq[..., rows, :] += dq_part
        dkv = torch.zeros(kv.shape, dtype=lse.dtype, device=kv.device)
        dkv[0][:, :, keys], dkv[1][:, :, keys] = dk, dv
        dkv_sink.add(source, dkv)
        del kv, dkv
    return dq
