"""Data for GPT pretraining: Megatron-compatible indexed datasets, tokenizers, GPT samples, splits, blends.

The API `pretrain_gpt.py` uses:

    tok = build_tokenizer(tokenizer_type, tokenizer_model=..., vocab_file=..., merge_file=...)
    tok.vocab_size, tok.eod, tok.tokenize(text), tok.detokenize(ids)
    train, valid, test = build_gpt_datasets(data_path, split, seq_length, seed,
                                            (n_train, n_valid, n_test), cache_dir, group,
                                            vocab_size=tok.vocab_size)  # token ids checked against it
    train[i]["tokens"]  # int64[seq_length + 1]; i indexes a fixed global order, independent of DP size

Nothing here imports torch: the preprocessing workers stay light, and groups are used by duck typing.
"""

from mpzero.data.blended_dataset import BlendedDataset, build_blending_indices
from mpzero.data.builder import build_gpt_datasets
from mpzero.data.gpt_dataset import GPTDataset, build_gpt_indices, build_sample_index
from mpzero.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, optimal_dtype
from mpzero.data.splits import parse_data_path, parse_split
from mpzero.data.tokenizer import TOKENIZER_TYPES, NullTokenizer, build_tokenizer
from mpzero.data.tokenizer_identity import (check_checkpoint_tokenizer, check_data_tokenizers, no_tokenizer,
                                            same_tokenizer, tokenizer_identity)
from mpzero.data.tokenizer_identity import describe as describe_tokenizer

__all__ = [
    "BlendedDataset", "GPTDataset", "IndexedDataset", "IndexedDatasetBuilder", "NullTokenizer", "TOKENIZER_TYPES",
    "build_blending_indices", "build_gpt_datasets", "build_gpt_indices", "build_sample_index",
    "build_tokenizer", "check_checkpoint_tokenizer", "check_data_tokenizers", "describe_tokenizer", "no_tokenizer",
    "optimal_dtype", "parse_data_path", "parse_split", "same_tokenizer", "tokenizer_identity",
]
