"""RMSNorm over the last dimension: a Triton kernel beside the PyTorch reference it must match.

y = x * rstd * weight with rstd = 1 / sqrt(mean(x^2) + eps) (Zhang and Sennrich 2019; LLaMA's norm, no mean
subtracted, no bias). x may be fp32/fp16/bf16; the weight and the statistics are fp32 and y has x's dtype, the
contract of `layer_norm` (HF's LlamaRMSNorm casts the normalized x back to the input dtype before the weight:
the same in fp32, one rounding apart in bf16). The backward kernel writes dx and one fp32 row of dweight partial
sums per program, summed afterwards: deterministic, unlike atomics.
"""

from __future__ import annotations

import torch

from mpzero.fused.impl import KernelSpec, dispatch, jit, launch_device, row_block, tl, triton
from mpzero.fused.layer_norm import MAX_WIDTH, check_norm_inputs, reduction_grid


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 (statistics included), returned in x's dtype."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


@jit
def _rms_norm_fwd_kernel(X, Y, W, Rstd, n_rows, n_cols, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    inside = row_ok[:, None] & col_ok[None, :]
    offs = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(X + offs, mask=inside, other=0.0).to(tl.float32)  # masked lanes are 0: they add nothing below
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / n_cols + eps)
    w = tl.load(W + cols, mask=col_ok, other=0.0)
    tl.store(Y + offs, (x * rstd[:, None] * w[None, :]).to(Y.dtype.element_ty), mask=inside)
    tl.store(Rstd + rows, rstd, mask=row_ok)


@jit
def _rms_norm_bwd_kernel(DY, X, W, Rstd, DX, DW_part, n_rows, n_cols, rows_per_program,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    w = tl.load(W + cols, mask=col_ok, other=0.0)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = pid * rows_per_program  # rows_per_program is a multiple of BLOCK_M
    for start in range(first, first + rows_per_program, BLOCK_M):
        rows = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < n_rows
        inside = row_ok[:, None] & col_ok[None, :]
        offs = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(X + offs, mask=inside, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=inside, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + rows, mask=row_ok, other=0.0)
        xhat = x * rstd[:, None]
        wdy = dy * w[None, :]
        c = tl.sum(xhat * wdy, axis=1) / n_cols  # [BLOCK_M]
        dx = (wdy - xhat * c[:, None]) * rstd[:, None]
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=inside)
        dw += tl.sum(dy * xhat, axis=0)
    tl.store(DW_part + pid * n_cols + cols, dw, mask=col_ok)


class _TritonRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        n_cols = x.shape[-1]
        x2 = x.reshape(-1, n_cols).contiguous()  # [rows, n_cols]
        n_rows = x2.shape[0]
        block_m, block_n, warps = row_block(n_cols, MAX_WIDTH, "rms_norm")
        y = torch.empty_like(x2)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        with launch_device(x2):
            _rms_norm_fwd_kernel[(triton.cdiv(n_rows, block_m),)](x2, y, weight, rstd, n_rows, n_cols, eps,
                                                                  BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = x2.shape
        block_m, block_n, warps = row_block(n_cols, MAX_WIDTH, "rms_norm")
        programs, rows_per_program = reduction_grid(n_rows, block_m, x2.device)
        dx = torch.empty_like(x2)
        dw_part = torch.empty(programs, n_cols, dtype=torch.float32, device=x2.device)
        with launch_device(x2):
            _rms_norm_bwd_kernel[(programs,)](dy.reshape(-1, n_cols).contiguous(), x2, weight, rstd, dx, dw_part,
                                              n_rows, n_cols, rows_per_program,
                                              BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
        return dx.view(ctx.x_shape), dw_part.sum(0), None


def _triton_rms_norm(x, weight, eps):
    return _TritonRMSNorm.apply(x, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, impl: str = "auto") -> torch.Tensor:
    """RMSNorm over x's last dimension (autograd-aware); `impl` as in `mpzero.fused.impl`."""
    check_norm_inputs("rms_norm", "RMSNorm", x, weight=weight)
    fn = dispatch("rms_norm", x.device, impl, {"torch": rms_norm_reference, "triton": _triton_rms_norm})
    return fn(x, weight, eps)


def triton_kernel_specs() -> list[KernelSpec]:
    """Compile-only variants: forward and backward for each input dtype, at a LLaMA-sized width."""
    block_m, block_n, warps = row_block(1024, MAX_WIDTH, "rms_norm")
    blocks = {"BLOCK_M": block_m, "BLOCK_N": block_n}
    specs = []
    for dt in ("fp32", "fp16", "bf16"):
        fwd = {"X": f"*{dt}", "Y": f"*{dt}", "W": "*fp32", "Rstd": "*fp32", "n_rows": "i32", "n_cols": "i32",
               "eps": "fp32"}
        bwd = {"DY": f"*{dt}", "X": f"*{dt}", "W": "*fp32", "Rstd": "*fp32", "DX": f"*{dt}", "DW_part": "*fp32",
               "n_rows": "i32", "n_cols": "i32", "rows_per_program": "i32"}
        specs.append(KernelSpec(f"rms_norm_fwd_{dt}", _rms_norm_fwd_kernel, fwd, blocks, warps))
        specs.append(KernelSpec(f"rms_norm_bwd_{dt}", _rms_norm_bwd_kernel, bwd, blocks, warps))
    return specs
