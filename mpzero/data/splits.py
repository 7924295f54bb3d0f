"""Parsing `--split 969,30,1` and `--data-path [W1] P1 [W2] P2 ...` the way Megatron-LM does.

A split string gives train/valid/test weights (missing ones are 0), normalised to fractions; split k
owns the documents [round(begin_k * n), round(end_k * n)) of a dataset of n documents, so the three
splits are contiguous, disjoint and cover everything. A zero weight gives no split (None).
"""

from __future__ import annotations

import math
import os
import re

from mpzero.errors import ConfigError

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> list[tuple[float, float] | None]:
    """'969,30,1' -> [(0, 0.969), (0.969, 0.999), (0.999, 1.0)]; a zero weight -> None."""
    parts = [p.strip() for p in re.split(r"[,/]", split)]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ConfigError(f"--split {split!r} is not numbers: write train,valid,test weights like 969,30,1") from None
    if not all(math.isfinite(w) for w in weights):
        raise ConfigError(f"--split {split!r} holds a weight that is not a finite number: write weights like 969,30,1")
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"--split {split!r} needs 1 to 3 non-negative weights with a positive sum, e.g. 969,30,1")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    bounds, begin = [], 0.0
    for w in weights:
        end = begin + w / total
        bounds.append((begin, end) if end > begin else None)
        begin = end
    return bounds


def split_document_range(bounds: tuple[float, float], num_documents: int) -> tuple[int, int]:
    """The [first, last) document ids a split's fractional bounds select."""
    return int(round(bounds[0] * num_documents)), int(round(bounds[1] * num_documents))


def parse_data_path(data_path: list[str]) -> tuple[list[str], list[float]]:
    """['A'] -> (['A'], [1.0]); ['0.3', 'A', '0.7', 'B'] -> (['A', 'B'], [0.3, 0.7]) with weights normalised;
    a part of weight 0 is dropped (['0', 'A', '1', 'B'] -> (['B'], [1.0]))."""
    if not data_path:
        raise ConfigError("--data-path is empty: give a dataset prefix, or weight/prefix pairs like 0.3 A 0.7 B")
    if len(data_path) == 1:
        return [data_path[0]], [1.0]
    if len(data_path) % 2:
        raise ConfigError(f"--data-path {' '.join(data_path)}: with several datasets give weight/prefix "
                          f"pairs, e.g. 0.3 A 0.7 B")
    prefixes, weights = data_path[1::2], []
    for raw in data_path[0::2]:
        try:
            weights.append(float(raw))
        except ValueError:
            raise ConfigError(f"--data-path weight {raw!r} is not a number: give weight/prefix pairs, "
                              f"e.g. 0.3 A 0.7 B") from None
    if not all(math.isfinite(w) for w in weights):
        raise ConfigError(f"--data-path weights {weights} must be finite numbers")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"--data-path weights {weights} must be non-negative with a positive sum")
    seen = {}
    for prefix in prefixes:
        key = os.path.abspath(prefix[:-4] if prefix.endswith((".bin", ".idx")) else prefix)
        if key in seen:
            raise ConfigError(f"--data-path lists {seen[key]} twice (as {seen[key]} and {prefix}): its samples "
                              f"would be drawn twice per epoch; give it once, with the two weights summed")
        seen[key] = prefix
    # A weight-0 part takes no samples: it is dropped here, wherever it stands (not opened, not blended).
    kept = [(p, w) for p, w in zip(prefixes, weights) if w > 0]
    total = sum(w for _, w in kept)
    return [p for p, _ in kept], [w / total for _, w in kept]
