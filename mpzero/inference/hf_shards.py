"""A state dict as Hugging Face's sharded safetensors files, as `save_pretrained(max_shard_size=...)` names them:
one `model.safetensors` when it fits in one shard, else `model-00001-of-0000N.safetensors`, ... and
`model.safetensors.index.json` ({"metadata": {"total_size": bytes}, "weight_map": {tensor: file}}), which
`from_pretrained` and tools/import_hf.py read. Tensors fill the shards in order, a shard closing before the tensor
that would take it past the limit (a tensor larger than the limit gets a shard of its own)."""

from __future__ import annotations

import re

import torch

SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
INDEX = "model.safetensors.index.json"


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
