"""Every kernel variant compiles to PTX and cubin for sm_80 and sm_90 without a GPU (real Triton
compiler, in a subprocess without TRITON_INTERPRET, with a fresh cache so nothing is reused)."""

import os
import subprocess
import sys
from pathlib import Path

from mpzero.fused.targets import all_kernel_specs
from tests.fused.helpers import needs_triton

REPO = Path(__file__).resolve().parents[2]


@needs_triton
def test_every_kernel_compiles_for_sm80_and_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "mpzero.fused.targets", "80", "90"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    compiled = {tuple(line.split()[1:3]) for line in proc.stdout.splitlines() if line.startswith("ok ")}
    expected = {(spec.name, f"sm_{cc}") for spec in all_kernel_specs() for cc in (80, 90)}
    assert compiled == expected
    assert len(expected) == 2 * 20  # LayerNorm 2 x 3 dtypes, softmax 3 x 3, AdamW 5 grad/copy variants
