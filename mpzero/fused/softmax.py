"""Scaled masked softmax over attention scores: a Triton kernel beside the PyTorch reference it must match.

probs = softmax(scale * scores) along the last dim of scores [b, heads, sq, sk], over the keys a query may
see. Excluded keys: `causal` excludes key k for query q when k > q (upper-triangular, top-left aligned as
torch's `is_causal`); `mask` is a bool tensor broadcastable to [b, heads, sq, sk] where True EXCLUDES the
position (Megatron's convention). Convention: a query with every key excluded gets all-zero probabilities
and zero gradient (not NaN, not uniform). Statistics are fp32; probs have scores' dtype.

Megatron fuses only some shapes (`fused_softmax_supported`); our kernel handles any width up to MAX_WIDTH.
"""

from __future__ import annotations

import torch

from mpzero.errors import ConfigError
from mpzero.fused.impl import KernelSpec, dispatch, jit, launch_device, row_block, tl, triton

MAX_WIDTH = 16384  # keys held in registers per row, as in layer_norm


def _excluded(scores: torch.Tensor, causal: bool, mask: torch.Tensor | None) -> torch.Tensor | None:
    """Bool [.., sq, sk] (broadcastable to scores), True where a key is excluded; None when nothing is."""
    sq, sk = scores.shape[-2:]
    excluded = mask
    if causal:
        upper = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu_(1)
        excluded = upper if mask is None else (mask | upper)
    return excluded


def scaled_masked_softmax_reference(scores: torch.Tensor, scale: float, causal: bool,
                                    mask: torch.Tensor | None) -> torch.Tensor:
    """softmax in fp32 over the non-excluded keys; fully excluded rows give zeros (fwd and bwd)."""
    x = scores.float() * scale
    excluded = _excluded(scores, causal, mask)
    if excluded is None:
        return torch.softmax(x, dim=-1).to(scores.dtype)
    probs = torch.softmax(x.masked_fill(excluded, float("-inf")), dim=-1)
    # A fully excluded row is NaN here; every entry of it is excluded, so this zeroes it (and its gradient).
    return probs.masked_fill(excluded, 0.0).to(scores.dtype)


@jit
def _softmax_fwd_kernel(X, Y, Mask, scale, n_rows, sq, sk, heads, m_sb, m_sh, m_sq, m_sk,
                        CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # row = (b*heads + h)*sq + q
    cols = tl.arange(0, BLOCK_N)
    inside = (rows < n_rows)[:, None] & (cols < sk)[None, :]
    offs = rows[:, None] * sk + cols[None, :]
    x = tl.load(X + offs, mask=inside, other=0.0).to(tl.float32) * scale
    keep = inside
    q = rows % sq
    if CAUSAL:
        keep = keep & (cols[None, :] <= q[:, None])
    if HAS_MASK:
        bh = rows // sq
        row_base = (bh // heads) * m_sb + (bh % heads) * m_sh + q * m_sq
        excluded = tl.load(Mask + row_base[:, None] + cols[None, :] * m_sk, mask=inside, other=1)
        keep = keep & (excluded == 0)
    x = tl.where(keep, x, float("-inf"))
    row_max = tl.max(x, axis=1)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # fully excluded row: no inf - inf
    e = tl.where(keep, tl.exp(x - row_max[:, None]), 0.0)
    total = tl.sum(e, axis=1)
    total = tl.where(total == 0.0, 1.0, total)  # fully excluded row: 0 / 1 = zeros
    tl.store(Y + offs, (e / total[:, None]).to(Y.dtype.element_ty), mask=inside)


@jit
def _softmax_bwd_kernel(DY, Y, DX, scale, n_rows, sk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    inside = (rows < n_rows)[:, None] & (cols < sk)[None, :]
    offs = rows[:, None] * sk + cols[None, :]
    y = tl.load(Y + offs, mask=inside, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=inside, other=0.0).to(tl.float32)
    # dx = scale * y * (dy - sum(dy * y)); excluded keys have y = 0, so their gradient is 0.
    dot = tl.sum(y * dy, axis=1)
    tl.store(DX + offs, (scale * y * (dy - dot[:, None])).to(DX.dtype.element_ty), mask=inside)


class _TritonSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, scale, causal, mask):
        b, heads, sq, sk = scores.shape
        x = scores.contiguous()
        n_rows = b * heads * sq
        block_m, block_n, warps = row_block(sk, MAX_WIDTH, "scaled_masked_softmax")
        y = torch.empty_like(x)
        if mask is None:
            mask_arg, strides = x, (0, 0, 0, 0)  # never read: HAS_MASK is False
        else:
            mask_arg = mask.expand(b, heads, sq, sk).view(torch.uint8)  # broadcast dims get stride 0
            strides = mask_arg.stride()
        grid = (triton.cdiv(n_rows, block_m),)
        with launch_device(x):
            _softmax_fwd_kernel[grid](x, y, mask_arg, scale, n_rows, sq, sk, heads, *strides,
                                      CAUSAL=causal, HAS_MASK=mask is not None,
                                      BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        sk = y.shape[-1]
        n_rows = y.numel() // sk
        block_m, block_n, warps = row_block(sk, MAX_WIDTH, "scaled_masked_softmax")
        dx = torch.empty_like(y)
        with launch_device(y):
            _softmax_bwd_kernel[(triton.cdiv(n_rows, block_m),)](dy.contiguous(), y, dx, ctx.scale, n_rows, sk,
                                                                 BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
        return dx, None, None, None


def _triton_softmax(scores, scale, causal, mask):
    return _TritonSoftmax.apply(scores, scale, causal, mask)


def _check_inputs(scores: torch.Tensor, mask: torch.Tensor | None) -> None:
    if scores.dim() != 4:
        raise ConfigError(f"scaled_masked_softmax: scores must be [b, heads, sq, sk], got shape {tuple(scores.shape)}")
    if mask is None:
        return
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.device != scores.device:
        raise ConfigError(f"scaled_masked_softmax: mask must be a 4-D bool tensor (True = excluded) on "
                          f"{scores.device}, got {mask.dtype} of shape {tuple(mask.shape)} on {mask.device}")
    try:
        torch.broadcast_shapes(mask.shape, scores.shape)
    except RuntimeError:
        raise ConfigError(f"scaled_masked_softmax: mask shape {tuple(mask.shape)} does not broadcast to "
                          f"scores {tuple(scores.shape)}") from None


def scaled_masked_softmax(scores: torch.Tensor, scale: float, causal: bool, mask: torch.Tensor | None = None,
                          impl: str = "auto") -> torch.Tensor:
    """softmax(scale * scores) over non-excluded keys (see the module docstring), autograd-aware."""
    _check_inputs(scores, mask)
    fn = dispatch("scaled_masked_softmax", scores.device, impl,
                  {"torch": scaled_masked_softmax_reference, "triton": _triton_softmax})
    return fn(scores, float(scale), bool(causal), mask)


def _megatron_batch_per_block(sk: int) -> int:
    """Rows one 128-thread block of Megatron's kernel handles: a warp (or less) per row, 2 rows for sk <= 128."""
    pow2 = 1 << (sk - 1).bit_length()
    warp_size = min(pow2, 32)
    return (128 // warp_size) * (2 if pow2 <= 128 else 1)


def fused_softmax_supported(b: int, heads: int, sq: int, sk: int, dtype: torch.dtype, causal: bool) -> bool:
    """Megatron's gate for its fused softmax (FusedScaleMaskSoftmax.is_kernel_available in
    megatron/core/fusions/fused_softmax.py): fp16/bf16 scores, 16 < sk <= 4096, sq, sk and b*heads
    multiples of 4, and whole blocks: b*heads (causal) or sq (masked) divisible by batch-per-block.
    Its causal kernel also asserts sq == sk, which is folded in here. Megatron runs every other case
    unfused, in torch; our Triton kernel has no such limits, so this is for callers wanting Megatron parity.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        return False
    if not (16 < sk <= 4096 and sq % 4 == 0 and sk % 4 == 0 and (b * heads) % 4 == 0):
        return False
    per_block = _megatron_batch_per_block(sk)
    if causal:
        return sq == sk and (b * heads) % per_block == 0
    return sq % per_block == 0


def triton_kernel_specs() -> list[KernelSpec]:
    """Compile-only variants, for each scores dtype at sk = 1024: the forward with causal + mask, the
    causal-only forward (the GPT model's call: another constexpr, so another binary) and the backward."""
    block_m, block_n, warps = row_block(1024, MAX_WIDTH, "scaled_masked_softmax")
    blocks = {"BLOCK_M": block_m, "BLOCK_N": block_n}
    ints = {n: "i32" for n in ("n_rows", "sq", "sk", "heads", "m_sb", "m_sh", "m_sq", "m_sk")}
    specs = []
    for dt in ("fp32", "fp16", "bf16"):
        fwd = {"X": f"*{dt}", "Y": f"*{dt}", "Mask": "*u8", "scale": "fp32", **ints}
        bwd = {"DY": f"*{dt}", "Y": f"*{dt}", "DX": f"*{dt}", "scale": "fp32", "n_rows": "i32", "sk": "i32"}
        specs.append(KernelSpec(f"softmax_fwd_{dt}", _softmax_fwd_kernel, fwd,
                                {"CAUSAL": True, "HAS_MASK": True, **blocks}, warps))
        no_mask = {**fwd, "Mask": f"*{dt}"}  # the launch passes the scores as the unread Mask pointer
        specs.append(KernelSpec(f"softmax_fwd_causal_{dt}", _softmax_fwd_kernel, no_mask,
                                {"CAUSAL": True, "HAS_MASK": False, **blocks}, warps))
        specs.append(KernelSpec(f"softmax_bwd_{dt}", _softmax_bwd_kernel, bwd, blocks, warps))
    return specs
