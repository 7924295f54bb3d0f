"""Checksums of the stored chunks of a checkpoint (format 3), so that a flipped bit is found instead of loaded.

Each rank records, while DCP writes its chunks (ChunksSavePlanner.resolve_data), a checksum of every chunk it
actually writes (after DCP's dedup: the final local plan), and writes them after the save to

    iter_N/checksums/rank_00000.json    {"algorithm": "crc32c", "chunks": {key: {"0,128": checksum}}}

(offsets joined by commas). A load reads every rank's file and checks each stored chunk it reads; the
`verify` command of tools/checkpoint_util.py checks every stored chunk. The checksum is over the chunk's bytes
in the stored dtype, row-major: CRC-32C (the `crc32c` package, hardware-accelerated, ~11 GiB/s) or, where that
is not installed, zlib's CRC-32 (~2-3 GiB/s); the file says which, and a reader without the algorithm skips
the check with a note.
"""

from __future__ import annotations

import json
import os
import zlib

import torch

from mpzero.errors import ConfigError
from mpzero.files import write_atomically

try:
    import crc32c as crc32c_module
except ImportError:  # pragma: no cover - install_requires has it; fall back to the standard library
    crc32c_module = None

ALGORITHMS = {"crc32": zlib.crc32}
if crc32c_module is not None:
    ALGORITHMS["crc32c"] = crc32c_module.crc32c
ALGORITHM = "crc32c" if "crc32c" in ALGORITHMS else "crc32"
DIRECTORY = "checksums"


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor in row-major order (a copy only where the tensor is not contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def checksum(tensor: torch.Tensor, algorithm: str = ALGORITHM) -> int:
    return ALGORITHMS[algorithm](tensor_bytes(tensor))


def offsets_text(offsets) -> str:
    return ",".join(str(int(o)) for o in offsets)


def rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, DIRECTORY, f"rank_{rank:05d}.json")


def write_rank_checksums(directory: str, rank: int, records: dict[tuple[str, tuple[int, ...]], int],
                         algorithm: str = ALGORITHM) -> None:
    """This rank's {(key, offsets): checksum}, atomically, as checksums/rank_NNNNN.json."""
    chunks: dict[str, dict[str, int]] = {}
    for (key, offsets), value in sorted(records.items()):
        chunks.setdefault(key, {})[offsets_text(offsets)] = value
    os.makedirs(os.path.join(directory, DIRECTORY), exist_ok=True)
    write_atomically(rank_file(directory, rank), json.dumps({"algorithm": algorithm, "chunks": chunks}))


def read_checksums(directory: str, world: int, advice: str) -> tuple[str, dict[tuple[str, str], int]]:
    """(algorithm, {(key, offsets text): checksum}) from the `world` rank files a format-3 save wrote; a missing
    or damaged file is one ConfigError line naming it, ending with `advice`."""
    algorithm, table = None, {}
    for rank in range(world):
        path = rank_file(directory, rank)
        name = os.path.relpath(path, directory)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            file_algorithm, chunks = data["algorithm"], data["chunks"]
            for key, per_offsets in chunks.items():
                for offsets, value in per_offsets.items():
                    table[(key, offsets)] = int(value)
        except FileNotFoundError:
            raise ConfigError(f"checkpoint {directory}: {name} is missing: {advice}") from None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror else "damaged"
            raise ConfigError(f"checkpoint {directory}: {name} is unreadable ({reason}): {advice}") from None
        if algorithm is not None and file_algorithm != algorithm:
            raise ConfigError(f"checkpoint {directory}: {name} uses {file_algorithm}, the others {algorithm}: "
                              f"{advice}")
        algorithm = file_algorithm
    return algorithm or ALGORITHM, table
