"""The two ways a block of the ring or all-gather attention is computed (`blocks.forward_blocks`): "local", the
explicit maths of `blocks.block_forward`/`block_backward` in torch ops (any device, any dtype: the reference), and
"flash", the CPU's fused flash-attention kernel, called per block for its output and log-sum-exp, and in backward
with the merged output and log-sum-exp, which makes its gradients exactly the block's part (as torch's own ring
attention, `torch.distributed.tensor.experimental.context_parallel`, calls the CUDA kernels). torch has no public
function that returns the log-sum-exp or takes it back: these are the aten ops behind
`F.scaled_dot_product_attention` on a CPU. Grouped-query attention: each block's K/V are repeated to the query heads
for the kernel (a transient copy of the block), and their gradients summed back over each group's heads.

`block_kernel(asked, device_type)`: which one a run's `--attention-backend` gives on a device, or one ConfigError
line: on a CPU auto and flash take the kernel, local and unfused the explicit blocks; on CUDA auto, local and
unfused the explicit blocks (the CUDA kernels' log-sum-exp layouts are not wired in yet), flash and fused are
refused (use a2a, which runs any backend on 1/CP of the heads).
"""

from __future__ import annotations

import torch

from mpzero.context_parallel.blocks import block_backward, block_forward, statistics_dtype
from mpzero.errors import ConfigError
from mpzero.fused import planned_device_type

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def block_kernel(asked: str, device_type: str) -> str:
    """"flash" or "local" for `--attention-backend asked` under --cp-comm-type p2p or all_gather."""
    if asked in ("local", "unfused"):
        return "local"
    device_type = planned_device_type(device_type)  # the dry run's meta tensors run the CPU's kernels
    if device_type == "cpu" and asked in ("auto", "flash"):
        return "flash"
    if device_type != "cpu" and asked == "auto":
        return "local"
    raise ConfigError(f"--cp-comm-type p2p and all_gather run their blocks with the CPU's flash kernel or explicit "
                      f"scores (local), not --attention-backend {asked} on {device_type}: use --attention-backend "
                      f"local, or --cp-comm-type a2a (any backend on 1/CP of the heads)")


def _heads(x: torch.Tensor, n: int) -> torch.Tensor:
    """[b, g, s, d] keys or values -> [b, g n, s, d], each group's repeated for its n query heads."""
    return x if n == 1 else x.repeat_interleave(n, dim=1)


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`blocks.block_forward` on the CPU's flash kernel."""
    b, g, n, sq, d = q.shape
    out, lse = _FLASH(q.reshape(b, g * n, sq, d), _heads(k, n), _heads(v, n), 0.0, causal, scale=scale)
    wide = statistics_dtype(q.dtype)
    return out.view(b, g, n, sq, -1).to(wide), lse.view(b, g, n, sq).to(wide)


def flash_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                   out: torch.Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, ...]:
    """`blocks.block_backward` on the CPU's flash kernel: `out` and `lse` the merged ones of these query rows."""
    b, g, n, sq, d = q.shape
    sk, wide, dtype = k.size(2), lse.dtype, q.dtype
    rows = (b, g * n, sq, d)
    dq, dk, dv = _FLASH_BACKWARD(dout.reshape(rows).to(dtype), q.reshape(rows), _heads(k, n), _heads(v, n),
                                 out.reshape(rows).to(dtype), lse.reshape(b, g * n, sq).to(torch.float32
                                 if dtype != torch.float64 else dtype), 0.0, causal, scale=scale)
    dk, dv = (t.view(b, g, n, sk, -1).sum(2) for t in (dk, dv))
    return dq.view(b, g, n, sq, d).to(wide), dk.to(wide), dv.to(wide)


def local_backward(q, k, v, lse, dout, out, scale, causal):
    """`blocks.block_backward` with the kernels' arguments: rowsum(dO * O) from the merged output."""
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    return block_backward(q, k, v, lse, dout, delta, scale, causal)


KERNELS = {"local": (block_forward, local_backward), "flash": (flash_forward, flash_backward)}
