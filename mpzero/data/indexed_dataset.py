"""Megatron's indexed dataset (`{prefix}.bin` + `{prefix}.idx`): reader over numpy memmap and writer.

The .bin file is every sequence's tokens back to back in one dtype. The .idx file, little-endian:

    b"MMIDIDX\\x00\\x00"   magic (9 bytes)
    u64 1                  version
    u8  dtype code         1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    u64 sequence count N
    u64 document-index count D (documents + 1)
    int32[N] sequence lengths (tokens)
    int64[N] sequence pointers (byte offset of each sequence in .bin)
    int64[D] document indices (first sequence of each document, then N)

A document is one or more sequences (one, unless sentences were split). Files written here and by
Megatron-LM are interchangeable. The writer streams tokens to disk under temporary names and renames
them only once the index is complete, so a crash never leaves a half-written dataset behind.

Temporary names are `{prefix}.bin.tmp-{host}-{pid}` (and `.idx`): a writer killed outright (SIGKILL, power
loss) leaves its own, and the next writer of the same prefix deletes those of processes no longer running
on its host. Another host's (a shared file system) or a live process's are left alone.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
from array import array

import numpy as np

from mpzero.errors import ConfigError
from mpzero.files import atomic_open, open_beside, publish_file

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document-index count
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
               6: np.float64, 7: np.float32, 8: np.uint16}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}
_CHECK_CHUNK = 1 << 22  # entries per pass when validating arrays: bounded memory on huge indexes


def optimal_dtype(vocab_size: int) -> type:
    """Megatron's rule: uint16 when every token id fits with room to spare (vocab < 65,500), else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


class IndexedDataset:
    """Read-only view of `{prefix}.bin/.idx`; `ds[i]` is sequence i as a zero-copy memmap slice.

    The header, the array sizes and the pointers are checked against each other and against the .bin
    size at open, so a truncated or corrupt pair fails here with the file named, not mid-training.
    """

    def __init__(self, path_prefix: str):
        self.path_prefix = path_prefix
        self._index_digest = None
        idx_path, bin_path = index_file_path(path_prefix), data_file_path(path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise ConfigError(f"indexed dataset file {path} not found: check --data-path "
                                  f"(a prefix, without .bin/.idx) or run tools/preprocess_data.py")
        self.dtype, n, d = _read_header(idx_path)
        index = np.memmap(idx_path, dtype=np.uint8, mode="r")
        ptr_start = _HEADER.size + 4 * n
        self.sequence_lengths = index[_HEADER.size:ptr_start].view(np.int32)
        self.sequence_pointers = index[ptr_start:ptr_start + 8 * n].view(np.int64)
        self.document_indices = index[ptr_start + 8 * n:].view(np.int64)
        itemsize = np.dtype(self.dtype).itemsize
        bin_size = os.path.getsize(bin_path)
        _validate(idx_path, bin_path, self, itemsize, bin_size)
        # A zero-byte file cannot be memory-mapped; an empty array stands in for it.
        self._tokens = (np.memmap(bin_path, dtype=self.dtype, mode="r") if bin_size
                        else np.zeros(0, self.dtype))

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i, a view into the memory-mapped .bin."""
        size = int(self.sequence_lengths[i])
        length = size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {i} "
                             f"of {size} tokens in {self.path_prefix}")
        start = int(self.sequence_pointers[i]) // self._tokens.itemsize + offset
        return self._tokens[start:start + length]

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def index_digest(self) -> str:
        """sha256 of the whole .idx file: it fixes the dtype, every sequence length and pointer and the
        document boundaries, so anything derived from sizes alone (sample indices) can be keyed by it.
        Read once per object, in 16 MB pieces (the .idx is 12 bytes per sequence, small beside the .bin)."""
        if self._index_digest is None:
            digest = hashlib.sha256()
            with open(index_file_path(self.path_prefix), "rb") as f:
                while piece := f.read(1 << 24):
                    digest.update(piece)
            self._index_digest = digest.hexdigest()
        return self._index_digest

    def __getstate__(self):  # pickled for a DataLoader worker: reopen the files, never copy the tokens
        return self.path_prefix

    def __setstate__(self, path_prefix):
        self.__init__(path_prefix)


def _read_header(idx_path: str) -> tuple[type, int, int]:
    size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise ConfigError(f"{idx_path} is truncated ({size} bytes, the header alone is {_HEADER.size}): "
                          f"re-run tools/preprocess_data.py")
    magic, version, code, n, d = _HEADER.unpack(head)
    if magic != _MAGIC:
        raise ConfigError(f"{idx_path} is not a Megatron indexed-dataset index (bad magic {magic!r}): "
                          f"check the path or re-run tools/preprocess_data.py")
    if version != _VERSION or code not in DTYPE_CODES:
        raise ConfigError(f"{idx_path} has unsupported version {version} / dtype code {code} "
                          f"(expected version 1, codes {sorted(DTYPE_CODES)}): re-run preprocessing")
    expected = _HEADER.size + 12 * n + 8 * d
    if size != expected or d < 1:
        raise ConfigError(f"{idx_path} is truncated or corrupt: {size} bytes where its header "
                          f"({n} sequences, {d} document indices) implies {expected}; re-run preprocessing")
    return DTYPE_CODES[code], n, d


def _validate(idx_path: str, bin_path: str, ds: IndexedDataset, itemsize: int, bin_size: int) -> None:
    """Pointers must be the running byte sum of lengths, and the sum must equal the .bin size."""
    lengths, pointers, docs = ds.sequence_lengths, ds.sequence_pointers, ds.document_indices
    offset = 0
    for start in range(0, len(lengths), _CHECK_CHUNK):
        chunk = lengths[start:start + _CHECK_CHUNK].astype(np.int64)
        expected = offset + np.concatenate(([0], np.cumsum(chunk)[:-1])) * itemsize
        if (chunk < 0).any() or not np.array_equal(expected, pointers[start:start + _CHECK_CHUNK]):
            raise ConfigError(f"{idx_path} is corrupt: sequence lengths and pointers disagree near "
                              f"sequence {start}; re-run preprocessing")
        offset += int(chunk.sum()) * itemsize
    if offset != bin_size:
        raise ConfigError(f"{bin_path} has {bin_size} bytes but {idx_path} describes {offset}: the pair is "
                          f"truncated or mismatched; re-run preprocessing")
    if docs[0] != 0 or docs[-1] != len(lengths) or (np.diff(docs) < 0).any():
        raise ConfigError(f"{idx_path} is corrupt: document indices must rise from 0 to the sequence "
                          f"count {len(lengths)}; re-run preprocessing")


def _temporary_suffix(pid: int | None = None) -> str:
    return f".tmp-{socket.gethostname()}-{os.getpid() if pid is None else pid}"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def remove_stale_temporaries(path_prefix: str) -> list[str]:
    """Delete `{prefix}.bin/.idx` temporaries of writers on this host that are no longer running (a killed
    earlier run of the same prefix); returns the paths removed."""
    directory = os.path.dirname(os.path.abspath(path_prefix))
    host_tag = _temporary_suffix(0)[:-1]  # ".tmp-{host}-"
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for ext in (".bin", ".idx"):
        stem = os.path.basename(path_prefix) + ext + host_tag
        for name in names:  # stem, the pid, then the writer's random part: ".tmp-{host}-{pid}.{random}"
            pid = name[len(stem):].split(".")[0]
            if name.startswith(stem) and pid.isdigit() and int(pid) != os.getpid() and not _process_alive(int(pid)):
                path = os.path.join(directory, name)
                try:
                    os.remove(path)
                except FileNotFoundError:
                    continue  # another writer cleaned it first
                removed.append(path)
    return removed


class IndexedDatasetBuilder:
    """Writes `{prefix}.bin/.idx` incrementally: tokens go straight to disk, only the index stays in
    memory (12 bytes per sequence, 8 per document, in compact arrays). `finalize()` writes the index
    and renames both files into place; `abort()` (or an exception inside `with`) deletes them."""

    def __init__(self, path_prefix: str, dtype: type):
        if np.dtype(dtype) not in _CODE_OF:
            raise ConfigError(f"unsupported token dtype {dtype}: use one of {list(_CODE_OF)}")
        self.path_prefix, self.dtype = path_prefix, np.dtype(dtype)
        remove_stale_temporaries(path_prefix)
        self._tmp = _temporary_suffix()
        self._bin, self._bin_tmp = open_beside(data_file_path(path_prefix), self._tmp)
        self._lengths = array("i")      # int32 sequence lengths
        self._doc_indices = array("q", [0])  # int64, first sequence of each document

    def add_document(self, tokens: np.ndarray, lengths: list[int]) -> None:
        """One document: `tokens` (all its sequences concatenated), `lengths` (tokens per sequence)."""
        self.add_documents(tokens, lengths, [len(lengths)])

    def add_documents(self, tokens: np.ndarray, lengths: list[int], sequences_per_document: list[int]) -> None:
        """Several documents at once: their tokens back to back, every sequence's length, and how
        many sequences each document has (0 for an empty one)."""
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).data)  # no copy when already our dtype
        self._lengths.extend(lengths)
        end = self._doc_indices[-1]
        for count in sequences_per_document:
            end += count
            self._doc_indices.append(end)

    def add_index(self, other_prefix: str) -> None:
        """Append a whole existing dataset (same dtype), copying its .bin in 16 MB pieces."""
        other = IndexedDataset(other_prefix)
        if np.dtype(other.dtype) != self.dtype:
            raise ConfigError(f"{other_prefix} stores {np.dtype(other.dtype)} tokens but the output is "
                              f"{self.dtype}: merge only datasets made with the same tokenizer")
        base = len(self._lengths)
        # Raw bytes into the compact arrays: no Python int per entry (tolist() would cost ~36 B each).
        self._lengths.frombytes(np.asarray(other.sequence_lengths, dtype=np.int32).tobytes())
        self._doc_indices.frombytes((np.asarray(other.document_indices[1:], dtype=np.int64) + base).tobytes())
        with open(data_file_path(other_prefix), "rb") as src:
            while piece := src.read(1 << 24):
                self._bin.write(piece)

    def finalize(self) -> None:
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), np.int64)
        np.cumsum(lengths[:-1], out=pointers[1:])
        pointers *= self.dtype.itemsize
        docs = np.frombuffer(self._doc_indices, dtype=np.int64)
        # .bin first: a present .idx then always has its complete .bin.
        publish_file(self._bin_tmp, data_file_path(self.path_prefix))
        with atomic_open(index_file_path(self.path_prefix), self._tmp) as f:
            f.write(_HEADER.pack(_MAGIC, _VERSION, _CODE_OF[self.dtype], len(lengths), len(docs)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(docs.tobytes())

    def abort(self) -> None:
        self._bin.close()  # the .idx's temporary file, if any, was removed by atomic_open
        if os.path.lexists(self._bin_tmp):
            os.remove(self._bin_tmp)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finalize()
        else:
            self.abort()
