"""Reading a checkpoint that may come from someone else: DCP's `.metadata` without running what it asks for.

torch's FileSystemReader reads `.metadata` with plain `pickle.load`: a checkpoint from elsewhere could name any
importable callable (`os.system`, `subprocess.Popen`, ...) and pickle calls it while loading. Here the pickle
goes through an Unpickler that resolves only the classes DCP's metadata is made of (the dataclasses of
torch.distributed.checkpoint.metadata, the filesystem's per-chunk `_StorageInfo`, `torch.Size`, torch dtypes
and layouts, the recorded checkpoint path) and plain containers and scalars, which pickle builds without
looking anything up. Any other name is a `ForeignClassError` before anything is called. The classes were
enumerated by unpickling real mpzero checkpoints (any layout, with and without checksums) with a recording
Unpickler; calling any of them runs a constructor that only stores its arguments.

Every mpzero reader of a checkpoint uses `read_metadata` (the one-line checks before a load) and passes
`CheckpointReader(directory)` as DCP's storage reader, so DCP's own `read_metadata` inside `dcp.load` is this
one too. The shards (`__*.distcp`) are safe as they are: DCP reads each stored tensor with
`torch.load(weights_only=True)`, and mpzero's load planner refuses byte items (the only ones DCP unpickles
without `weights_only`). A shard that fails to load is a `ShardReadError` naming its file.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import pickletools
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from mpzero.errors import ConfigError

METADATA_FILE = ".metadata"

# (module, name) of every class or function a DCP .metadata may name; calling each only builds a value.
ADMITTED = frozenset({
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # where each chunk lies in which .distcp file
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how torch pickles a torch.layout: a lookup by its name
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id, as the writer gave it
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
})


class ForeignClassError(pickle.UnpicklingError):
    """A pickle that names something outside `ADMITTED`: refused before it is called."""

    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"it names {module}.{name}, which is not checkpoint metadata")
        self.qualified_name = f"{module}.{name}"


class ShardReadError(Exception):
    """Reading `file` (a .distcp shard) failed for `reason` (text: DCP pickles it across ranks)."""

    def __init__(self, file: str, reason: str) -> None:
        super().__init__(f"{file}: {reason}")
        self.file, self.reason = file, reason

    def __reduce__(self):
        return ShardReadError, (self.file, self.reason)


def error_reason(error: BaseException) -> str:
    """One short line saying why `error` happened."""
    if isinstance(error, ShardReadError):
        return str(error)
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = [line for line in str(error).strip().splitlines() if line.strip()]
    # torch.load(weights_only=True) explains itself over many lines; the one naming what it refused says why
    refused = [line for line in text if "GLOBAL" in line or line.startswith("Unsupported")]
    return f"{type(error).__name__}: {(refused or text)[-1][:200]}" if text else type(error).__name__


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f: BinaryIO, admitted: frozenset[tuple[str, str]]) -> None:
        super().__init__(f)
        self.admitted = admitted

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.admitted:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # torch pickles a dtype as the module attribute (torch.float32)
        raise ForeignClassError(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent reference, which checkpoint metadata never does")


# Protocol 5's mutable and out-of-band buffers, which metadata (pickled at protocol 2-4) never holds. A damaged
# file's BYTEARRAY8 claiming exabytes is worse than a MemoryError: CPython prints a SystemError past the caller.
_BUFFER_OPCODES = frozenset({"BYTEARRAY8", "NEXT_BUFFER", "READONLY_BUFFER"})


def load_metadata(f: BinaryIO, admitted: frozenset[tuple[str, str]] = ADMITTED) -> Any:
    """The object pickled in `f`, built from admitted classes only (ForeignClassError otherwise). Its opcodes are
    read first (pickletools, which allocates nothing a count claims): a count beyond the file's end or a buffer
    opcode is an UnpicklingError before anything is built."""
    data = f.read()
    try:
        for opcode, _, position in pickletools.genops(data):
            if opcode.name in _BUFFER_OPCODES:
                raise pickle.UnpicklingError(f"it holds {opcode.name} at byte {position}, which metadata never does")
    except ValueError as error:
        raise pickle.UnpicklingError(f"it is damaged ({error})") from None
    return _MetadataUnpickler(io.BytesIO(data), admitted).load()


def read_metadata(directory: str | os.PathLike, admitted: frozenset[tuple[str, str]] = ADMITTED) -> Metadata:
    """The DCP metadata of the checkpoint in `directory`; ForeignClassError for a file that names anything else,
    FileNotFoundError, or another exception for a damaged pickle."""
    return CheckpointReader(directory, admitted).read_metadata()


class CheckpointReader(FileSystemReader):
    """DCP's FileSystemReader with the metadata read through the restricted Unpickler: pass it as `dcp.load`'s
    `storage_reader` for every checkpoint that may come from someone else. `admitted`: the classes its
    .metadata may name (another writer's records added to mpzero's own: mpzero/inference/megatron_files.py)."""

    def __init__(self, path: str | os.PathLike, admitted: frozenset[tuple[str, str]] = ADMITTED) -> None:
        super().__init__(path)
        self.admitted = admitted

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        with open(os.path.join(os.fspath(self.path), name), "rb") as f:
            metadata = load_metadata(f, self.admitted)
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """FileSystemReader's read, one shard file at a time, so a failure names its file (ShardReadError);
        the planner's own ConfigErrors (a checksum mismatch names the file already) pass as they are."""
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except ConfigError:
                raise
            except Exception as error:  # noqa: BLE001 - a damaged or foreign shard raises anything
                raise ShardReadError(name, error_reason(error)) from error
        done: Future[None] = Future()
        done.set_result(None)
        return done
