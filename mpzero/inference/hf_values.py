"""A Hugging Face config.json's values typed strictly before use: each key HF's defaults name holds a value of
its default's type (an integer is no bool, a number is finite, a switch is true or false), so a damaged or
foreign config.json is one ConfigError line naming the key instead of a TypeError deep in the import. Each adapter
also names the pretrain_gpt.py flag each numeric key becomes (`HF_FLAGS`), so that tools/import_hf.py checks every
value within that flag's range (mpzero/cli/flag_ranges.py, the one table of ranges): `layer_norm_epsilon: -1.0` is
refused as `--layernorm-epsilon -1.0` would be; tests/test_hf_values.py fails on a numeric key that names none."""

from __future__ import annotations

import math

from mpzero.errors import ConfigError


def check_value_types(values: dict, defaults: dict, source: str) -> None:
    for key, default in defaults.items():
        value = values.get(key)
        if isinstance(value, bool) or isinstance(default, bool):
            ok, kind = isinstance(value, bool) and isinstance(default, bool), "true or false"
        elif default is None:  # an optional integer (n_inner, num_key_value_heads, head_dim)
            ok, kind = value is None or isinstance(value, int), "an integer or null"
        elif isinstance(default, int):
            ok, kind = isinstance(value, int), "an integer"
        elif isinstance(default, float):
            ok, kind = isinstance(value, (int, float)) and math.isfinite(value), "a finite number"
        else:
            ok, kind = isinstance(value, type(default)), f"a {type(default).__name__}"
        if not ok:
            raise ConfigError(f"{source}: {key} is {value!r}, not {kind}")

