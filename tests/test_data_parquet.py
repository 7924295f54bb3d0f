"""Parquet input (mpzero/data/parquet.py) for tools/preprocess_data.py and tools/train_tokenizer.py: the same
documents as JSONL give the same .bin/.idx bytes, at 1 and 2 workers, from files, directories and globs; a missing
or non-text column, a file that is not parquet and a null value are one line each."""

import json
import os
import runpy
import sys

import pytest

from tests.cli import ROOT
from tests.trained_gpt import corpus_texts

pa = pytest.importorskip("pyarrow")  # in the test extra: skipped only outside `make test`
import pyarrow.parquet as pq  # noqa: E402

TOOLS = os.path.join(ROOT, "tools")
preprocess_main = runpy.run_path(os.path.join(TOOLS, "preprocess_data.py"))["main"]
train_tokenizer_main = runpy.run_path(os.path.join(TOOLS, "train_tokenizer.py"))["main"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The same 700 documents as one JSONL file and as two parquet files (row groups of 50 rows) in a directory
    tree, FineWeb's layout, with an extra column; and a SentencePiece tokenizer trained here."""
    base = tmp_path_factory.mktemp("parquet")
    texts = corpus_texts(700) + ["", "naïve café — 東京 🙂\n\ttabs"]
    (base / "docs.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    for part, rows in enumerate((texts[:400], texts[400:])):
        (base / "fw" / f"CC-{part}").mkdir(parents=True)
        table = pa.table({"id": list(range(len(rows))), "text": rows})
        pq.write_table(table, base / "fw" / f"CC-{part}" / "000_00000.parquet", row_group_size=50)
    assert train_tokenizer_main(["--input", str(base / "docs.jsonl"), "--vocab-size", "500",
                                 "--output-prefix", str(base / "sp")]) == 0
    return base


def _preprocess(corpus, inputs, out, *extra):
    return preprocess_main(["--input", *inputs, "--output-prefix", str(out), "--tokenizer-type",
                            "GPTSentencePieceTokenizer", "--tokenizer-model", str(corpus / "sp.model"),
                            "--append-eod", "--no-progress", *extra])


def _files(prefix):
    return [open(f"{prefix}_text_document{ext}", "rb").read() for ext in (".bin", ".idx", ".tokenizer.json")]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_parquet_gives_the_jsonl_bytes(corpus, tmp_path, workers):
    assert _preprocess(corpus, [str(corpus / "docs.jsonl")], tmp_path / "j", "--workers", workers) == 0
    assert _preprocess(corpus, [str(corpus / "fw")], tmp_path / "p", "--workers", workers) == 0  # a directory
    assert _files(tmp_path / "p") == _files(tmp_path / "j")
    files = [str(corpus / "fw" / "CC-0" / "000_00000.parquet"), str(corpus / "fw" / "CC-1" / "000_00000.parquet")]
    assert _preprocess(corpus, [str(corpus / "fw" / "*" / "*.parquet")], tmp_path / "g", "--workers", workers) == 0
    assert _preprocess(corpus, files, tmp_path / "f", "--workers", workers) == 0
    assert _files(tmp_path / "g") == _files(tmp_path / "f") == _files(tmp_path / "j")


def test_presplit_sentence_lists_equal_jsonl(corpus, tmp_path):
    docs = [["In the beginning.", "", "God created."], [], ["Amen."]]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    pq.write_table(pa.table({"text": docs}), tmp_path / "s.parquet")
    assert _preprocess(corpus, [str(tmp_path / "s.jsonl")], tmp_path / "j") == 0
    assert _preprocess(corpus, [str(tmp_path / "s.parquet")], tmp_path / "p") == 0
    assert _files(tmp_path / "p") == _files(tmp_path / "j")


def test_the_tokenizer_trains_the_same_on_parquet(corpus, tmp_path):
    assert train_tokenizer_main(["--input", str(corpus / "fw"), "--vocab-size", "500",
                                 "--output-prefix", str(tmp_path / "sp")]) == 0
    assert (tmp_path / "sp.model").read_bytes() == (corpus / "sp.model").read_bytes()


def _one_error(corpus, capsys, inputs, *extra):
    assert _preprocess(corpus, inputs, corpus / "never", *extra) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert not os.path.exists(f"{corpus / 'never'}_text_document.bin")
    return err


def test_bad_parquet_input_is_one_line(corpus, tmp_path, capsys):
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocol.parquet")
    assert "nocol.parquet: no column 'text' (columns: body): pass the text column with --json-keys" in \
        _one_error(corpus, capsys, [str(tmp_path / "nocol.parquet")])
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    assert "ints.parquet: column 'text' is int64, not a string" in _one_error(corpus, capsys,
                                                                             [str(tmp_path / "ints.parquet")])
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    assert "junk.parquet is not a readable parquet file" in _one_error(corpus, capsys, [str(tmp_path / "junk.parquet")])
    assert "matches no file" in _one_error(corpus, capsys, [str(tmp_path / "*.nothing")])
    (tmp_path / "empty").mkdir()
    assert "is a directory with no .parquet files" in _one_error(corpus, capsys, [str(tmp_path / "empty")])


def test_a_null_row_is_malformed_and_skippable(corpus, tmp_path, capsys):
    pq.write_table(pa.table({"text": ["In the beginning.", None, "Amen."]}), tmp_path / "null.parquet")
    err = _one_error(corpus, capsys, [str(tmp_path / "null.parquet")])
    assert f"{tmp_path / 'null.parquet'}: row 2: key 'text' is null; fix or remove it, or pass --skip-malformed" in err
    assert _preprocess(corpus, [str(tmp_path / "null.parquet")], tmp_path / "o", "--skip-malformed") == 0
    assert f"skipped 1 malformed lines (first: {tmp_path / 'null.parquet'}: row 2" in capsys.readouterr().out


def test_without_pyarrow_parquet_input_is_one_line(corpus, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` raises ImportError, as when not installed
    assert "parquet input needs pyarrow, which is not installed: pip install -e '.[parquet]'" in \
        _one_error(corpus, capsys, [str(corpus / "fw")])
