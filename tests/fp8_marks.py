"""The FP8 tests' mark for the rowwise recipes, which need row-wise scales in the CPU's torch._scaled_mm: torch
2.13's has them, 2.11's does not (there a run says so in one line: tests/test_fp8.py)."""

import pytest

from mpzero.tensor_parallel.fp8 import cpu_rowwise_scaled_mm

needs_cpu_rowwise = pytest.mark.skipif(not cpu_rowwise_scaled_mm(),
                                       reason="this torch's CPU torch._scaled_mm takes one scale per tensor only")


def recipe_params(recipes: list[tuple[str, str]]) -> list:
    """(format, recipe) pairs for parametrize, the rowwise ones marked `needs_cpu_rowwise`."""
    return [pytest.param(*pair, marks=needs_cpu_rowwise) if pair[1] != "tensorwise" else pair for pair in recipes]
