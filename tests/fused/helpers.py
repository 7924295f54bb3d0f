"""Shared by the kernel tests: the skip marker for a missing triton and the dtype-aware tolerance."""

import pytest
import torch

from mpzero.fused import triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed (pip install 'mpzero[triton]')")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def tol(dtype: torch.dtype, ulps: float = 1.0) -> dict:
    """assert_close tolerance for a kernel output vs its reference.

    Both compute in fp32 and differ there by ~1e-6 (another summation order over at most a few thousand
    elements): rtol 1e-5 for fp32. Rounding that to fp16/bf16 flips at most one ulp (rtol = the dtype's
    eps); under the interpreter a bf16 store truncates where a GPU rounds to nearest, again one ulp.
    atol 1e-5 covers values near zero, where the fp32 difference is absolute.
    """
    rtol = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
    return {"rtol": ulps * rtol, "atol": 1e-5}
