"""Every kernel variant compiles to PTX and cubin for sm_80 and sm_90 without a GPU (real Triton
compiler, in a subprocess without TRITON_INTERPRET, with a fresh cache so nothing is reused)."""

import os
import subprocess
import sys
from pathlib import Path

from tests.fused.helpers import needs_triton

REPO = Path(__file__).resolve().parents[2]


@needs_triton
def test_every_kernel_compiles_for_sm80_and_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "tools/compile_kernels.py", "--capabilities", "80", "90"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    compiled = {tuple(line.split()[1:3]) for line in proc.stdout.splitlines() if line.startswith("ok ")}
    # Every variant the fused ops launch, enumerated here: LayerNorm and RMSNorm forward and backward per dtype, softmax
    # forward, causal forward and backward per dtype, and AdamW per (gradient dtype, model copy dtype) pair
    # the optimizer uses (fp32 training; bf16/fp16 mixed precision with fp32 or low-precision gradients), and the
    # norm's sum of squares per gradient dtype, unscaled and loss-scaled (by a float or a device scale).
    dtypes = ("fp32", "fp16", "bf16")
    names = ([f"{norm}_{d}_{t}" for norm in ("layer_norm", "rms_norm") for t in dtypes for d in ("fwd", "bwd")]
             + [f"softmax_{d}_{t}" for t in dtypes for d in ("fwd", "fwd_causal", "bwd")]
             + [f"adamw_grad_{g}_copy_{c}" for g, c in (("fp32", "none"), ("fp32", "bf16"), ("fp32", "fp16"),
                                                       ("bf16", "bf16"), ("fp16", "fp16"))]
             + ["adamw_grad_fp32_copy_none_on_device", "adamw_grad_fp32_copy_bf16_on_device"]  # launched steps
             + ["adamw_grad_fp32_copy_fp16_fp16_on_device"]  # fp16's launched step: its scalars in memory too
             + [f"sum_of_squares_{t}{s}" for t in dtypes for s in ("", "_scaled", "_scaled_in_memory")])
    expected = {(name, f"sm_{cc}") for name in names for cc in (80, 90)}
    assert len(expected) == 2 * 38  # LayerNorm and RMSNorm 2 x 3 dtypes each, softmax 3 x 3, AdamW 5 + 3, squares 9
    assert compiled == expected
