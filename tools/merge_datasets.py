"""Concatenate indexed datasets (`.bin/.idx` prefixes, same token dtype) into one, in the order given.

    python tools/merge_datasets.py --input data/kjv_text_document data/shakespeare_text_document \
        --output-prefix data/merged_text_document

An --input that is a directory stands for every prefix in it, sorted by name (Megatron's form), unless
it is also a prefix: training caches its indices in a directory named like the prefix. The
output's documents are the inputs' documents in order; it appears only once completely written, with
PREFIX.tokenizer.json when every input has the same one (inputs made with different tokenizers are refused).
"""

from __future__ import annotations

import os
import sys

from mpzero.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from mpzero.data.tokenizer_identity import (data_tokenizer, describe, remove_data_tokenizer,
                                            same_tokenizer, write_data_tokenizer)
from mpzero.cli import INPUT_ERRORS, OUTPUT_PREFIX, Parser, Text, exit_code
from mpzero.errors import ConfigError


def parse_args(argv):
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--input", type=Text(), nargs="+", required=True, help="dataset prefixes, or directories of them")
    p.add_argument("--output-prefix", type=OUTPUT_PREFIX, required=True)
    return p.parse_args(argv)


def input_prefixes(inputs: list[str]) -> list[str]:
    prefixes = []
    for item in inputs:
        # `data/x_text_document/` is also the default index cache of prefix `data/x_text_document`.
        if os.path.isdir(item) and not os.path.isfile(item + ".idx"):
            found = sorted(os.path.join(item, f[:-4]) for f in os.listdir(item) if f.endswith(".idx"))
            if not found:
                raise ConfigError(f"--input directory {item} holds no .idx files")
            seen = set()  # a link beside its dataset (latest.idx -> v2.idx) is that dataset: merged once
            for prefix in found:
                if os.path.realpath(prefix + ".idx") not in seen:
                    seen.add(os.path.realpath(prefix + ".idx"))
                    prefixes.append(prefix)
        else:
            prefixes.append(item[:-4] if item.endswith((".bin", ".idx")) else item)
    return prefixes


def merge(inputs: list[str], output_prefix: str) -> tuple[int, int]:
    """Write the merged dataset; returns (documents, sequences)."""
    prefixes = input_prefixes(inputs)
    if os.path.abspath(output_prefix) in map(os.path.abspath, prefixes):
        raise ConfigError(f"--output-prefix {output_prefix} is also an input: choose a new name")
    first = IndexedDataset(prefixes[0])  # opening validates; add_index re-validates every input
    record = _common_tokenizer(prefixes)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    with IndexedDatasetBuilder(output_prefix, first.dtype) as builder:
        for prefix in prefixes:
            builder.add_index(prefix)
        remove_data_tokenizer(output_prefix)
    if record is not None:
        write_data_tokenizer(output_prefix, record)
    merged = IndexedDataset(output_prefix)
    return merged.num_documents, len(merged)


def _common_tokenizer(prefixes: list[str]) -> dict | None:
    """The tokenizer every input was made with (their PREFIX.tokenizer.json), None where one is unknown; inputs
    made with different tokenizers are refused: their ids mean different text."""
    records = [(prefix, data_tokenizer(prefix)[0]) for prefix in prefixes]
    known = [(prefix, record) for prefix, record in records if record is not None]
    for prefix, record in known[1:]:
        if not same_tokenizer(record, known[0][1]):
            raise ConfigError(f"--input {known[0][0]} was tokenized with {describe(known[0][1])} and {prefix} with "
                              f"{describe(record)}: their ids mean different text; preprocess them with one tokenizer")
    return known[0][1] if known and len(known) == len(prefixes) else None


def main(argv=None) -> int:
    args = parse_args(argv)

    def run() -> None:
        documents, sequences = merge(args.input, args.output_prefix)
        print(f"wrote {args.output_prefix}.bin/.idx: {documents} documents, {sequences} sequences")
    return exit_code(run, INPUT_ERRORS)


if __name__ == "__main__":
    sys.exit(main())
