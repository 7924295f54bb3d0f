"""LayerNorm over the last dimension: a Triton kernel beside the PyTorch reference it must match.

y = (x - mean) * rstd * weight + bias with rstd = 1 / sqrt(var + eps), as `F.layer_norm`. x may be
fp32/fp16/bf16; weight, bias and the statistics are fp32 and y has x's dtype (apex FusedLayerNorm's
mixed-precision contract). The backward kernel writes dx and one fp32 row of dweight/dbias partial sums
per program, summed afterwards: deterministic, unlike atomics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpzero.errors import ConfigError
from mpzero.fused.impl import KernelSpec, dispatch, jit, launch_device, row_block, tl, triton

# One row lives in registers; 16384 fp32 is 64 KiB per row, the largest width worth one pass.
MAX_WIDTH = 16384


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """F.layer_norm computed in fp32 (statistics included), returned in x's dtype."""
    return F.layer_norm(x.float(), x.shape[-1:], weight, bias, eps).to(x.dtype)


@jit
def _layer_norm_fwd_kernel(X, Y, W, B, Mean, Rstd, n_rows, n_cols, eps,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    inside = row_ok[:, None] & col_ok[None, :]
    offs = rows[:, None] * n_cols + cols[None, :]
    # bf16 is computed in fp32 right after the load (also the interpreter's only correct bf16 path).
    x = tl.load(X + offs, mask=inside, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / n_cols
    xc = tl.where(inside, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(xc * xc, axis=1) / n_cols + eps)
    w = tl.load(W + cols, mask=col_ok, other=0.0)
    b = tl.load(B + cols, mask=col_ok, other=0.0)
    y = xc * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=inside)
    tl.store(Mean + rows, mean, mask=row_ok)
    tl.store(Rstd + rows, rstd, mask=row_ok)


@jit
def _layer_norm_bwd_kernel(DY, X, W, Mean, Rstd, DX, DW_part, DB_part, n_rows, n_cols, rows_per_program,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    w = tl.load(W + cols, mask=col_ok, other=0.0)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = pid * rows_per_program  # rows_per_program is a multiple of BLOCK_M
    for start in range(first, first + rows_per_program, BLOCK_M):
        rows = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < n_rows
        inside = row_ok[:, None] & col_ok[None, :]
        offs = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(X + offs, mask=inside, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=inside, other=0.0).to(tl.float32)
        mean = tl.load(Mean + rows, mask=row_ok, other=0.0)
        rstd = tl.load(Rstd + rows, mask=row_ok, other=0.0)
        xhat = tl.where(inside, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = dy * w[None, :]
        c1 = tl.sum(xhat * wdy, axis=1) / n_cols  # [BLOCK_M]
        c2 = tl.sum(wdy, axis=1) / n_cols
        dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=inside)
        dw += tl.sum(dy * xhat, axis=0)
        db += tl.sum(dy, axis=0)
    tl.store(DW_part + pid * n_cols + cols, dw, mask=col_ok)
    tl.store(DB_part + pid * n_cols + cols, db, mask=col_ok)


def reduction_grid(n_rows: int, block_m: int, device: torch.device) -> tuple[int, int]:
    """(programs, rows per program) of a norm's backward: a few programs per SM on a GPU, two under the interpreter,
    each a whole number of row blocks, and at least one (with no rows it writes zero partial sums)."""
    wanted = 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    programs = max(1, min(wanted, triton.cdiv(n_rows, block_m)))
    rows_per_program = max(1, triton.cdiv(triton.cdiv(n_rows, programs), block_m)) * block_m
    return max(1, triton.cdiv(n_rows, rows_per_program)), rows_per_program


class _TritonLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        n_cols = x.shape[-1]
        x2 = x.reshape(-1, n_cols).contiguous()  # [rows, n_cols]
        n_rows = x2.shape[0]
        block_m, block_n, warps = row_block(n_cols, MAX_WIDTH, "layer_norm")
        y = torch.empty_like(x2)
        mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty_like(mean)
        grid = (triton.cdiv(n_rows, block_m),)
        with launch_device(x2):
            _layer_norm_fwd_kernel[grid](x2, y, weight, bias, mean, rstd, n_rows, n_cols, eps,
                                         BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, mean, rstd = ctx.saved_tensors
        n_rows, n_cols = x2.shape
        block_m, block_n, warps = row_block(n_cols, MAX_WIDTH, "layer_norm")
        programs, rows_per_program = reduction_grid(n_rows, block_m, x2.device)
        dx = torch.empty_like(x2)
        dw_part = torch.empty(programs, n_cols, dtype=torch.float32, device=x2.device)
        db_part = torch.empty_like(dw_part)
        with launch_device(x2):
            _layer_norm_bwd_kernel[(programs,)](dy.reshape(-1, n_cols).contiguous(), x2, weight, mean, rstd, dx,
                                                dw_part, db_part, n_rows, n_cols, rows_per_program,
                                                BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
        return dx.view(ctx.x_shape), dw_part.sum(0), db_part.sum(0), None


def _triton_layer_norm(x, weight, bias, eps):
    return _TritonLayerNorm.apply(x, weight, bias, eps)


def check_norm_inputs(op: str, module: str, x: torch.Tensor, **params: torch.Tensor) -> None:
    """A norm's contract: fp32, contiguous parameters of x's width on x's device; x in fp32/fp16/bf16."""
    width = x.shape[-1]
    for name, t in params.items():
        if t.dtype != torch.float32 or t.shape != (width,) or not t.is_contiguous() or t.device != x.device:
            raise ConfigError(f"{op}: {name} must be a contiguous fp32 tensor of shape ({width},) on "
                              f"{x.device}, got {t.dtype} {tuple(t.shape)} on {t.device}: keep {module} "
                              f"parameters in fp32 beside the input")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ConfigError(f"{op}: input dtype {x.dtype} is not fp32/fp16/bf16")


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5,
               impl: str = "auto") -> torch.Tensor:
    """LayerNorm over x's last dimension (autograd-aware); `impl` as in `mpzero.fused.impl`."""
    check_norm_inputs("layer_norm", "LayerNorm", x, weight=weight, bias=bias)
    fn = dispatch("layer_norm", x.device, impl, {"torch": layer_norm_reference, "triton": _triton_layer_norm})
    return fn(x, weight, bias, eps)


def triton_kernel_specs() -> list[KernelSpec]:
    """Compile-only variants: forward and backward for each input dtype, at a GPT-sized width."""
    block_m, block_n, warps = row_block(1024, MAX_WIDTH, "layer_norm")
    blocks = {"BLOCK_M": block_m, "BLOCK_N": block_n}
    specs = []
    for dt in ("fp32", "fp16", "bf16"):
        fwd = {"X": f"*{dt}", "Y": f"*{dt}", "W": "*fp32", "B": "*fp32", "Mean": "*fp32", "Rstd": "*fp32",
               "n_rows": "i32", "n_cols": "i32", "eps": "fp32"}
        bwd = {"DY": f"*{dt}", "X": f"*{dt}", "W": "*fp32", "Mean": "*fp32", "Rstd": "*fp32", "DX": f"*{dt}",
               "DW_part": "*fp32", "DB_part": "*fp32", "n_rows": "i32", "n_cols": "i32", "rows_per_program": "i32"}
        specs.append(KernelSpec(f"layer_norm_fwd_{dt}", _layer_norm_fwd_kernel, fwd, blocks, warps))
        specs.append(KernelSpec(f"layer_norm_bwd_{dt}", _layer_norm_bwd_kernel, bwd, blocks, warps))
    return specs
