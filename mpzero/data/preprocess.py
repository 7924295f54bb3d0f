"""JSONL or parquet -> Megatron indexed datasets, streaming, with parallel workers that keep document order.

The main process reads raw lines in small batches (bounded: at most `2 * workers + 2` batches of
~128 KB are in flight), workers parse and tokenize them, and the main process writes the results in
input order as they complete. With one worker everything runs in the main process: no pickling, so
its rate stays close to the tokenizer's own. Token arrays go straight to the output .bin; outputs are
renamed into place only when the whole input was read without error, each with PREFIX.tokenizer.json (the
tokenizer's type and files' sha256, tokenizer_identity.py) beside it. Under `signals_as_interrupts()`
(tools/preprocess_data.py) a SIGINT/SIGTERM removes the temporary files like any other error; one that
arrives while the outputs are being renamed into place lets them all be renamed, and the run completes.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from contextlib import closing
from dataclasses import dataclass

import numpy as np

from mpzero.data.indexed_dataset import IndexedDatasetBuilder, optimal_dtype
from mpzero.data.interrupts import deferred_interrupts, worker_signals
from mpzero.data.jsonl import LineBatch, check_inputs, read_batches
from mpzero.data.tokenizer import build_tokenizer
from mpzero.data.tokenizer_identity import remove_data_tokenizer, tokenizer_identity, write_data_tokenizer
from mpzero.errors import ConfigError

_BATCH_LINES, _BATCH_BYTES = 128, 128 << 10  # small enough that the last batches balance across workers


@dataclass(frozen=True)
class PreprocessConfig:
    inputs: list[str]
    output_prefix: str
    json_keys: list[str]
    tokenizer: dict  # build_tokenizer keyword arguments
    append_eod: bool = False
    workers: int = 1
    log_interval: int = 1000
    skip_malformed: bool = False


@dataclass
class PreprocessStats:
    documents: int = 0
    tokens: int = 0
    bytes: int = 0
    skipped: int = 0
    first_skipped: str = ""
    seconds: float = 0.0


def output_prefix_for(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"


@dataclass
class _EncodedBatch:
    """One input batch, tokenized: per key, every document's tokens back to back, the sequence
    lengths, and sequences per document; so the writer does O(1) work per batch, not per document."""
    documents: int
    tokens: dict[str, np.ndarray]
    sequence_lengths: dict[str, list[int]]
    sequences_per_document: dict[str, list[int]]
    malformed: list[tuple[int, str]]  # (line number, reason)


class _Encoder:
    """Parses and tokenizes batches; one per worker process (or the main one when workers == 1)."""

    def __init__(self, tokenizer_kwargs: dict, json_keys: list[str], append_eod: bool):
        self.tokenizer = build_tokenizer(**tokenizer_kwargs)
        self.dtype = optimal_dtype(self.tokenizer.vocab_size)
        self.json_keys, self.append_eod = json_keys, append_eod
        self._eod = np.array([self.tokenizer.eod], dtype=self.dtype)

    def encode_batch(self, batch: LineBatch) -> _EncodedBatch:
        docs, malformed = [], []  # docs: (line or row number, {key: [text, ...]})
        for number, doc, reason in batch.documents(self.json_keys):
            if reason is not None:
                malformed.append((number, reason))
            elif doc is not None:
                docs.append((number, doc))
        try:
            encoded = self._encode_documents(docs)
        except ValueError:  # text the tokenizer rejects (NullTokenizer: not integer ids): find its lines
            docs, rejected = self._split_rejected(docs)
            malformed = sorted(malformed + rejected)
            encoded = self._encode_documents(docs)
        return _EncodedBatch(len(docs), *encoded, malformed)

    def _split_rejected(self, docs: list) -> tuple[list, list[tuple[int, str]]]:
        """(documents the tokenizer accepts, [(line number, reason)] for those it rejects)."""
        accepted, rejected = [], []
        for line_number, doc in docs:
            try:
                self._encode_documents([(line_number, doc)])
                accepted.append((line_number, doc))
            except ValueError as exc:
                rejected.append((line_number, f"cannot tokenize: {exc}"))
        return accepted, rejected

    def _encode_documents(self, docs: list) -> tuple[dict, dict, dict]:
        """Per key: the documents' tokens back to back, every sequence's length, sequences per document.
        One tokenizer call per key for the whole batch. As Megatron, an empty sentence adds no sequence."""
        tokens, lengths, counts = {}, {}, {}
        for key in self.json_keys:
            per_doc = [doc[key] for _, doc in docs]
            ids = iter(self.tokenizer.tokenize_batch([text for texts in per_doc for text in texts]))
            parts, lengths[key], counts[key] = [], [], []
            for texts in per_doc:
                sequences = [a for a in itertools.islice(ids, len(texts)) if len(a)]
                sequence_lengths = [len(a) for a in sequences]
                if sequences and self.append_eod:
                    sequences.append(self._eod)
                    sequence_lengths[-1] += 1
                parts += sequences
                lengths[key] += sequence_lengths
                counts[key].append(len(sequence_lengths))
            # ids are below the vocabulary size, which optimal_dtype chose to fit
            tokens[key] = np.concatenate(parts).astype(self.dtype, copy=False) if parts else self._eod[:0]
        return tokens, lengths, counts


# Each pool worker's own _Encoder, set once by _init_worker inside that worker (the main process never
# touches it). A process pool has no other place for per-worker state: the initializer's return value is
# dropped, and sending the encoder with every batch would reload the tokenizer per batch.
_worker_encoder: list = []


def _init_worker(*args) -> None:
    worker_signals()  # Ctrl-C is the main process's to handle; die with it if it is killed
    _worker_encoder.append(_Encoder(*args))


def _encode_in_worker(batch: LineBatch):
    return _worker_encoder[0].encode_batch(batch)


def _encoded_batches(cfg: PreprocessConfig, inputs: list[str], encoder: _Encoder):
    """(input batch, _EncodedBatch) per input batch, in input order."""
    batches = read_batches(inputs, _BATCH_LINES, _BATCH_BYTES, cfg.json_keys)
    if cfg.workers == 1:
        for batch in batches:
            yield batch, encoder.encode_batch(batch)
        return
    init = (cfg.tokenizer, cfg.json_keys, cfg.append_eod)
    pool = ProcessPoolExecutor(cfg.workers, initializer=_init_worker, initargs=init)
    try:
        pending = deque()
        for batch in batches:
            pending.append((batch, pool.submit(_encode_in_worker, batch)))
            if len(pending) >= 2 * cfg.workers + 2:  # bounded memory: wait before reading further
                batch, future = pending.popleft()
                yield batch, future.result()
        while pending:
            batch, future = pending.popleft()
            yield batch, future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def preprocess(cfg: PreprocessConfig, progress: bool = True) -> PreprocessStats:
    """Write `{output_prefix}_{key}_document.bin/.idx` for every JSON key; returns the counts."""
    inputs = check_inputs(cfg.inputs)
    if cfg.workers < 1:
        raise ConfigError(f"--workers {cfg.workers}: need at least 1")
    encoder = _Encoder(cfg.tokenizer, cfg.json_keys, cfg.append_eod)  # checks the tokenizer before any work
    os.makedirs(os.path.dirname(os.path.abspath(cfg.output_prefix)), exist_ok=True)
    builders, stats, start = {}, PreprocessStats(), time.perf_counter()
    try:
        for key in cfg.json_keys:  # inside the try: if one cannot be opened, the others' files go too
            builders[key] = IndexedDatasetBuilder(output_prefix_for(cfg.output_prefix, key), encoder.dtype)
        with _progress_bar(inputs, progress) as bar, closing(_encoded_batches(cfg, inputs, encoder)) as results:
            for source, batch in results:
                _write_batch(cfg, builders, source, batch, stats)
                nbytes = source.nbytes
                stats.bytes += nbytes
                if stats.documents // cfg.log_interval != (stats.documents - batch.documents) // cfg.log_interval:
                    _show_rates(bar, stats, start)
                bar.update(nbytes)
            _show_rates(bar, stats, start)
        # A signal now waits until every output is renamed into place, then is dropped: the run is complete
        # (its summary prints and the process ends); raising it would report "nothing written" falsely.
        # Each dataset's tokenizer record goes first and comes back last (tokenizer_identity.py): it never
        # describes data it did not see made.
        record = tokenizer_identity(encoder.tokenizer)
        with deferred_interrupts(reraise=False):
            for key, builder in builders.items():
                remove_data_tokenizer(builder.path_prefix)
                builder.finalize()
                write_data_tokenizer(builder.path_prefix, record)
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    stats.seconds = time.perf_counter() - start
    return stats


def _write_batch(cfg: PreprocessConfig, builders: dict, source, batch: _EncodedBatch,
                 stats: PreprocessStats) -> None:
    for line_number, reason in batch.malformed:
        where = f"{source.location(line_number)}: {reason}"
        if not cfg.skip_malformed:
            raise ConfigError(f"{where}; fix or remove it, or pass --skip-malformed to skip such lines")
        stats.skipped += 1
        stats.first_skipped = stats.first_skipped or where
    for key, builder in builders.items():
        builder.add_documents(batch.tokens[key], batch.sequence_lengths[key], batch.sequences_per_document[key])
        stats.tokens += len(batch.tokens[key])
    stats.documents += batch.documents


def _progress_bar(inputs: list[str], enabled: bool):
    from tqdm import tqdm

    # .gz: the uncompressed size is unknown; parquet: the bar counts the text's bytes, not the file's
    unknown = any(p.endswith((".gz", ".parquet")) for p in inputs)
    total = None if unknown else sum(os.path.getsize(p) for p in inputs)
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                disable=not enabled, desc="preprocess", mininterval=0.5)


def _show_rates(bar, stats: PreprocessStats, start: float) -> None:
    elapsed = max(time.perf_counter() - start, 1e-9)
    bar.set_postfix_str(f"{stats.documents} docs, {stats.documents / elapsed:.0f} docs/s, "
                        f"{stats.tokens / 1e6:.2f}M tokens", refresh=False)
