"""Tokenizers under Megatron's names: SentencePiece for GPT, GPT-2 BPE from local files, the null one."""

import gzip
import io
import json
import os

import pytest
import sentencepiece as spm

from mpzero.data import build_tokenizer
from mpzero.errors import ConfigError

SAMPLE = os.path.join(os.path.dirname(__file__), "..", "data_sample", "kjv_sample.jsonl.gz")


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    with gzip.open(SAMPLE, "rt") as f:
        texts = [json.loads(next(f))["text"] for _ in range(40)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=model, vocab_size=600,
                                   model_type="bpe", max_sentence_length=1 << 16, minloglevel=2)
    path = tmp_path_factory.mktemp("sp") / "m.model"
    path.write_bytes(model.getvalue())
    return str(path), texts


def test_sentencepiece_tokenizer_matches_raw_sentencepiece(sp_model):
    path, texts = sp_model
    tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=path)
    raw = spm.SentencePieceProcessor(model_file=path)
    assert tok.vocab_size == raw.vocab_size() == 600 and tok.eod == raw.eos_id() == 2
    ids = tok.tokenize(texts[3])
    assert ids == raw.encode(texts[3]) and raw.bos_id() not in ids and tok.eod not in ids  # no BOS/EOS added
    assert tok.detokenize(ids) == raw.decode(ids)


def test_tokenize_batch_matches_tokenize_for_every_tokenizer(sp_model, tmp_path):
    path, texts = sp_model
    vocab, merges = _gpt2_files(tmp_path)
    cases = [(build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=path), [texts[0], "", texts[5]]),
             (build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges), ["hello world", ""]),
             (build_tokenizer("NullTokenizer", vocab_size=100), ["5 7 99", "", "0"])]
    for tok, batch in cases:
        assert [a.tolist() for a in tok.tokenize_batch(batch)] == [tok.tokenize(t) for t in batch]


def _gpt2_files(tmp_path):
    # A miniature GPT-2 vocabulary: byte-level symbols ("Ġ" is the space byte) and five merges.
    vocab = {"h": 0, "e": 1, "l": 2, "o": 3, "\u0120": 4, "w": 5, "r": 6, "d": 7, "he": 8, "ll": 9, "hell": 10,
             "hello": 11, "\u0120w": 12, "<|endoftext|>": 13}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\nh e\nl l\nhe ll\nhell o\n\u0120 w\n")
    return str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")


def test_gpt2_bpe_tokenizer_matches_hand_applied_merges(tmp_path):
    vocab, merges = _gpt2_files(tmp_path)
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert tok.vocab_size == 14 and tok.eod == 13
    # "hello" merges all the way; " world" is pre-split off with its space, which merges with "w".
    assert tok.tokenize("hello world") == [11, 12, 3, 6, 2, 7]
    assert tok.detokenize([11, 12, 3, 6, 2, 7]) == "hello world"


def test_null_tokenizer_reads_ids_and_adds_eod():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.tokenize("5 7 99") == [5, 7, 99] and tok.eod == 100 and tok.vocab_size == 101
    assert tok.detokenize([5, 7]) == "5 7"


def test_build_tokenizer_errors_name_the_problem(tmp_path, sp_model):
    with pytest.raises(ConfigError, match="GPTSentencePieceTokenizer, GPT2BPETokenizer, HuggingFaceTokenizer, Null"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(ConfigError, match="needs --tokenizer-model"):
        build_tokenizer("GPTSentencePieceTokenizer")
    with pytest.raises(ConfigError, match="does not exist"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "v.json"), merge_file=sp_model[0])
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="not a SentencePiece model"):
        build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=str(tmp_path / "junk.model"))
    with pytest.raises(ConfigError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")
