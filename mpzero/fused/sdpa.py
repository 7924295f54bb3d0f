"""Whether torch's fused attention kernels take a run's attention.

F.scaled_dot_product_attention falls back to its math path without a word when none of its fused kernels
(FlashAttention, memory-efficient, cuDNN) accepts the inputs: a head size, a dtype, dropout on a CPU
(pytorch#107884). The math path computes explicit [s, s] scores and probabilities. It is far slower, and it holds
memory that the activation formula for flash attention does not count. `fused_attention_refusal` asks torch once,
on the run's device, with the run's head layout, dtype and dropout. It runs one forward and one backward at
batch 1 with the fused kernels alone allowed, and returns torch's reasons if none of them runs. The training
start stops a GPU run on them and notes them on a CPU (`mpzero.training.startup`).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# The kernels each SDPA-based backend may run: flash lets torch's dispatcher pick among the fused ones; fused is
# cuDNN's alone (mpzero.models.attention runs it under sdpa_kernel(CUDNN_ATTENTION)).
FUSED_KERNELS = {"flash": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION],
                 "fused": [SDPBackend.CUDNN_ATTENTION]}
_TRIGGERED = re.compile(r"\s*\(Triggered internally at [^)]*\)\.?")


@dataclass(frozen=True)
class AttentionShape:
    """One TP rank's attention in a run: its query heads, its key/value heads (GQA groups; = heads without GQA),
    the head size, the sequence length, the dtype and the dropout probability."""
    heads: int
    kv_heads: int
    head_dim: int
    seq_length: int
    dtype: torch.dtype
    dropout: float

    def describe(self) -> str:
        kv = f" sharing {self.kv_heads} key/value heads" if self.kv_heads != self.heads else ""
        return (f"{self.heads} heads{kv} of size {self.head_dim}, sequence {self.seq_length}, "
                f"{str(self.dtype).removeprefix('torch.')}, dropout {self.dropout:g}")


def fused_attention_refusal(backend: str, shape: AttentionShape, device: torch.device) -> str | None:
    """None if a kernel of `backend` (flash or fused) runs causal attention of `shape` on `device`, forward and
    backward; else the reasons torch gave for each kernel it turned down, in one line. Other backends (local,
    unfused) compute their scores explicitly by design: None. The reasons carry no final full stop. The probe's
    tensors are zeros, and the RNG states are restored afterwards (dropout draws from them), so the run's random
    numbers are unchanged."""
    if backend not in FUSED_KERNELS:
        return None
    q = torch.zeros(1, shape.heads, shape.seq_length, shape.head_dim, dtype=shape.dtype, device=device,
                    requires_grad=True)
    k, v = (torch.zeros(1, shape.kv_heads, shape.seq_length, shape.head_dim, dtype=shape.dtype, device=device,
                        requires_grad=True) for _ in range(2))
    devices = [device] if device.type == "cuda" else []
    with warnings.catch_warnings(record=True) as caught, torch.random.fork_rng(devices=devices):
        warnings.simplefilter("always")
        try:
            with torch.enable_grad(), sdpa_kernel(FUSED_KERNELS[backend]):
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=shape.dropout, is_causal=True,
                                                     enable_gqa=shape.kv_heads != shape.heads)
                out.sum().backward()
            return None
        except RuntimeError as error:
            reasons = [" ".join(_TRIGGERED.sub("", str(w.message)).split()).rstrip(".") for w in caught]
            reasons = ([r for r in reasons if r and not r.endswith("because:")]
                       or [" ".join(str(error).split()).rstrip(".")])
            return "; ".join(dict.fromkeys(reasons))
