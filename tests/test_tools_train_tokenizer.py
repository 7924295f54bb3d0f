"""tools/train_tokenizer.py: a deterministic SentencePiece model with EOD that round-trips real text."""

import gzip
import json
import os
import runpy

import pytest

from mpzero.data import build_tokenizer

TOOLS = os.path.join(os.path.dirname(__file__), "..", "tools")
train_main = runpy.run_path(os.path.join(TOOLS, "train_tokenizer.py"))["main"]
SAMPLE = os.path.join(os.path.dirname(__file__), "..", "data_sample", "kjv_sample.jsonl.gz")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    with gzip.open(SAMPLE, "rt") as f:
        texts = [json.loads(next(f))["text"] for _ in range(50)]
    path = tmp_path_factory.mktemp("c") / "c.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path), texts


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_trained_tokenizer_is_deterministic_and_round_trips(tmp_path, corpus, model_type):
    path, texts = corpus
    for name in ("a", "b"):
        assert train_main(["--input", path, "--vocab-size", "700", "--model-type", model_type,
                           "--output-prefix", str(tmp_path / name)]) == 0
    assert (tmp_path / "a.model").read_bytes() == (tmp_path / "b.model").read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["a.model", "a.vocab", "b.model", "b.vocab"]
    tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=str(tmp_path / "a.model"))
    assert tok.vocab_size == 700 and tok.eod == 2
    unseen = "Zebra café 2024!\n\n  tabs\tand ünïcode ✓"  # byte fallback: nothing becomes <unk>
    for text in (texts[7], unseen):
        ids = tok.tokenize(text)
        assert tok.detokenize(ids) == text and 0 not in ids and tok.eod not in ids
    assert len(texts[7]) / len(tok.tokenize(texts[7])) > 2.5  # real merges were learned, not just bytes


def test_train_tokenizer_errors(tmp_path, corpus, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a b c"}\n{"text": oops}\n')
    assert train_main(["--input", str(bad), "--vocab-size", "400", "--output-prefix", str(tmp_path / "t")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {bad}:2: invalid JSON")
    assert train_main(["--input", corpus[0], "--vocab-size", "50", "--output-prefix", str(tmp_path / "t")]) == 2
    assert "--vocab-size 50 is too small" in capsys.readouterr().err
    assert train_main(["--input", corpus[0], "--vocab-size", "90000", "--output-prefix", str(tmp_path / "t")]) == 2
    assert capsys.readouterr().err.startswith("error: SentencePiece training failed")
    assert os.listdir(tmp_path) == ["bad.jsonl"]


@pytest.mark.parametrize("tokenizer_type", ["GPTSentencePieceTokenizer", "HuggingFaceTokenizer"])
@pytest.mark.parametrize("lines,why", [("", "it holds no documents"), ("\n\n", "it holds no documents"),
                                        ('{"text": ""}\n', "it holds no documents"),
                                        ('{"text": null}\n{"text": null}\n', "all 2 lines were malformed")])
def test_a_corpus_with_no_text_is_one_line_and_writes_nothing(tmp_path, capsys, tokenizer_type, lines, why):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(lines)
    assert train_main(["--input", str(empty), "--vocab-size", "300", "--output-prefix", str(tmp_path / "t"),
                       "--tokenizer-type", tokenizer_type, "--skip-malformed"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --input {empty} gives no text to train on ({why}"), err
    assert os.listdir(tmp_path) == ["empty.jsonl"]
