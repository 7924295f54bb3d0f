"""A state dict as Hugging Face's sharded safetensors files, as `save_pretrained(max_shard_size=...)` names them:
one `model.safetensors` when it fits in one shard, else `model-00001-of-0000N.safetensors`, ... and
`model.safetensors.index.json` ({"metadata": {"total_size": bytes}, "weight_map": {tensor: file}}), which
`from_pretrained` and tools/import_hf.py read. Tensors fill the shards in order, a shard closing before the tensor
that would take it past the limit (a tensor larger than the limit gets a shard of its own)."""

from __future__ import annotations

import re

import torch

from mpzero.errors import ConfigError

SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
INDEX = "model.safetensors.index.json"
_UNITS = {"B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12, "KIB": 2 ** 10, "MIB": 2 ** 20,
          "GIB": 2 ** 30}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes of a size as HF writes it ("5GB", "100KB", "2GiB"); anything else is one ConfigError line."""
    match = _SIZE.match(text) if isinstance(text, str) else None
    if match is None:
        raise ConfigError(f"--max-shard-size {text!r} is not a size such as 5GB, 500MB or 2GiB")
    size = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if size < 1:
        raise ConfigError(f"--max-shard-size {text!r} must be at least one byte")
    return size


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """[(file name, its tensors)] in order."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        if groups[-1] and size + _bytes(t) > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += _bytes(t)
    if len(groups) == 1:
        return [("model.safetensors", groups[0])]
    n = len(groups)
    return [(f"model-{i:05d}-of-{n:05d}.safetensors", group) for i, group in enumerate(groups, start=1)]


def index(files: list[tuple[str, dict[str, torch.Tensor]]]) -> dict | None:
    """The index.json of sharded files (None for one file)."""
    if len(files) == 1:
        return None
    total = sum(_bytes(t) for _, group in files for t in group.values())
    return {"metadata": {"total_size": total},
            "weight_map": {name: file for file, group in files for name in group}}
