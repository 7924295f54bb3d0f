"""Compile every fused Triton kernel variant to PTX and cubin for real NVIDIA targets, without a GPU.

    python tools/compile_kernels.py [--capabilities 80 90]

Run WITHOUT TRITON_INTERPRET (an interpreted kernel cannot be compiled); point TRITON_CACHE_DIR at a fresh directory
to force real compilation. Prints one line per kernel variant and target; exits 1 if any failed.
"""

from __future__ import annotations

import sys

from mpzero.cli import Number, Parser, run_or_exit
from mpzero.errors import ConfigError
from mpzero.fused.compile import all_kernel_specs, compile_spec
from mpzero.fused.impl import INTERPRETED, triton


def parse_args(argv=None):
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--capabilities", type=Number(int, low=50, high=1000), nargs="+", default=[80, 90],
                   help="CUDA compute capabilities, e.g. 80 (sm_80, A100) and 90 (sm_90, H100)")
    return p.parse_args(argv)


def compile_all(capabilities: list[int]) -> int:
    """Failures, after a line for every kernel variant and target."""
    if triton is None or INTERPRETED:
        raise ConfigError("compiling the kernels needs triton installed and TRITON_INTERPRET unset")
    failed = 0
    for spec in all_kernel_specs():
        for cc in capabilities:
            try:
                r = compile_spec(spec, cc)
                print(f"ok   {r.name:28s} sm_{cc}  ptx {r.ptx_bytes:7d} B  cubin {r.cubin_bytes:7d} B  {r.seconds:5.2f} s")
            except Exception as exc:  # report every variant, then fail
                failed += 1
                print(f"FAIL {spec.name:28s} sm_{cc}  {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    return failed


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_or_exit(lambda: 1 if compile_all(args.capabilities) else 0)


if __name__ == "__main__":
    sys.exit(main())
