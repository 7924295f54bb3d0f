"""tools/preprocess_data.py end to end: exact output for known ids, order kept with workers, gzip,
the dtype switch, and malformed input stopping with file and line and no output left behind."""

import gzip
import json
import os
import runpy

import numpy as np
import pytest

from mpzero.data import IndexedDataset

TOOLS = os.path.join(os.path.dirname(__file__), "..", "tools")
preprocess_main = runpy.run_path(os.path.join(TOOLS, "preprocess_data.py"))["main"]
train_tokenizer_main = runpy.run_path(os.path.join(TOOLS, "train_tokenizer.py"))["main"]
SAMPLE = os.path.join(os.path.dirname(__file__), "..", "data_sample", "kjv_sample.jsonl.gz")


def _jsonl(path, docs, raw_lines=()):
    lines = [json.dumps(d).encode() + b"\n" for d in docs] + list(raw_lines)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.writelines(lines)
    return str(path)


def _null_args(inp, out, *extra, vocab=1000):
    return ["--input", inp, "--output-prefix", out, "--tokenizer-type", "NullTokenizer", "--vocab-size",
            str(vocab), "--no-progress", *extra]


def _docs(n=300):
    rng = np.random.default_rng(0)
    return [[int(x) for x in rng.integers(0, 1000, size=rng.integers(0, 20))] for _ in range(n)]


@pytest.mark.parametrize("workers", [1, 3])
def test_preprocess_output_matches_input_ids_in_order(tmp_path, workers):
    docs = _docs()
    inp = _jsonl(tmp_path / "in.jsonl.gz", [{"text": " ".join(map(str, d)), "title": str(len(d))} for d in docs])
    out = str(tmp_path / "out")
    assert preprocess_main(_null_args(inp, out, "--append-eod", "--json-keys", "text", "title",
                                      "--workers", str(workers))) == 0
    text = IndexedDataset(out + "_text_document")
    nonempty = [d for d in docs if d]  # as Megatron: an empty document has no sequence
    assert text.num_documents == len(docs) and len(text) == len(nonempty)
    for i, d in enumerate(nonempty):
        assert text[i].tolist() == d + [1000]  # EOD = vocab_size for the NullTokenizer
    title = IndexedDataset(out + "_title_document")
    assert [title[i].tolist() for i in range(len(title))] == [[len(d), 1000] for d in docs]
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl.gz"] + [f"out_{key}_document{ext}" for key in ("text", "title")
                                                              for ext in (".bin", ".idx", ".tokenizer.json")]


def test_preprocess_output_is_identical_for_1_and_2_workers(tmp_path):
    inp = _jsonl(tmp_path / "in.jsonl", [{"text": " ".join(map(str, d))} for d in _docs(1000)])
    for w in (1, 2):
        assert preprocess_main(_null_args(inp, str(tmp_path / f"w{w}"), "--workers", str(w))) == 0
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"w1_text_document{ext}").read_bytes() == (tmp_path / f"w2_text_document{ext}").read_bytes()


@pytest.mark.parametrize("vocab, code", [(65498, 8), (65499, 4)])  # the NullTokenizer adds one id for EOD
def test_preprocess_dtype_switches_at_65500(tmp_path, vocab, code):
    inp = _jsonl(tmp_path / "in.jsonl", [{"text": "1 2 3"}])
    assert preprocess_main(_null_args(inp, str(tmp_path / "o"), vocab=vocab)) == 0
    assert (tmp_path / "o_text_document.idx").read_bytes()[17] == code


@pytest.mark.parametrize("bad_line, reason", [
    (b'{"text": "1 2"\n', "invalid JSON"),
    (b'{"body": "1 2"}\n', "no key 'text'"),
    (b'{"text": "1 \xff 2"}\n', "invalid UTF-8"),
    (b'{"text": 12}\n', "key 'text' is not a string"),
    (b'["1 2"]\n', "not a JSON object"),
    (b'{"text": "1 x"}\n', "cannot tokenize"),
])
def test_malformed_line_stops_naming_file_and_line_and_leaves_nothing(tmp_path, capsys, bad_line, reason):
    inp = _jsonl(tmp_path / "in.jsonl", [{"text": "1 2"}] * 300, raw_lines=[b"\n", bad_line, b'{"text": "3"}\n'])
    for workers in ("1", "2"):
        assert preprocess_main(_null_args(inp, str(tmp_path / "out"), "--workers", workers)) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"error: {inp}:302: {reason}") and "--skip-malformed" in err
        assert os.listdir(tmp_path) == ["in.jsonl"]  # no output, no temporary files


def test_truncated_gzip_input_stops_naming_the_file_and_leaves_nothing(tmp_path, capsys):
    full = _jsonl(tmp_path / "full.jsonl.gz", [{"text": " ".join(map(str, d))} for d in _docs(3000)])
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(open(full, "rb").read()[:os.path.getsize(full) // 2])
    os.remove(full)
    assert preprocess_main(_null_args(str(cut), str(tmp_path / "out"), "--workers", "2")) == 2
    assert capsys.readouterr().err.startswith(f"error: {cut}: cannot read past line ")
    assert os.listdir(tmp_path) == ["cut.jsonl.gz"]


def test_output_that_cannot_be_opened_leaves_nothing(tmp_path, capsys):
    # The second key's output lies in a missing directory: the first key's temporary file goes too.
    inp = _jsonl(tmp_path / "in.jsonl", [{"text": "1", "no/dir": "2"}])
    assert preprocess_main(_null_args(inp, str(tmp_path / "out"), "--json-keys", "text", "no/dir")) == 2
    assert "No such file or directory" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["in.jsonl"]


def test_skip_malformed_counts_and_reports(tmp_path, capsys):
    # Line 5 parses but the tokenizer rejects it: only that line of its batch is dropped.
    inp = _jsonl(tmp_path / "in.jsonl", [{"text": "1 2"}], raw_lines=[b"oops\n", b'{"text": "3"}\n', b"{}\n",
                                                                      b'{"text": "1 x"}\n', b'{"text": "4"}\n'])
    assert preprocess_main(_null_args(inp, str(tmp_path / "out"), "--skip-malformed")) == 0
    assert f"skipped 3 malformed lines (first: {inp}:2: invalid JSON" in capsys.readouterr().out
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [3], [4]]


def test_presplit_sentences_become_sequences_as_in_megatron(tmp_path):
    # A list value is a document of sentences: one sequence each, none for an empty one, EOD on the last.
    inp = _jsonl(tmp_path / "in.jsonl", [{"text": ["1 2", "", "3"]}, {"text": ["", ""]}, {"text": ["4"]}])
    assert preprocess_main(_null_args(inp, str(tmp_path / "out"), "--append-eod")) == 0
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [3, 1000], [4, 1000]]
    assert ds.document_indices.tolist() == [0, 2, 2, 3]


def test_bad_arguments_print_one_error_line(tmp_path, capsys):
    assert preprocess_main(_null_args(str(tmp_path / "missing.jsonl"), str(tmp_path / "o"))) == 2
    assert capsys.readouterr().err == f"error: --input {tmp_path / 'missing.jsonl'} does not exist: " \
                                      f"give a JSONL file (optionally .gz) or parquet files\n"
    inp = _jsonl(tmp_path / "in.jsonl", [{"text": "1"}])
    assert preprocess_main(["--input", inp, "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "BPE"]) == 2
    assert "unknown --tokenizer-type 'BPE'" in capsys.readouterr().err


def test_sample_corpus_quickstart_trains_tokenizes_and_round_trips(tmp_path):
    """The bundled KJV sample through both tools: the documents come back exactly, EOD after each."""
    with gzip.open(SAMPLE, "rt") as f:
        texts = [json.loads(next(f))["text"] for _ in range(60)]
    inp = _jsonl(tmp_path / "kjv.jsonl", [{"text": t} for t in texts])
    assert train_tokenizer_main(["--input", inp, "--vocab-size", "800", "--output-prefix", str(tmp_path / "tok")]) == 0
    assert preprocess_main(["--input", inp, "--output-prefix", str(tmp_path / "kjv"), "--tokenizer-type",
                            "GPTSentencePieceTokenizer", "--tokenizer-model", str(tmp_path / "tok.model"),
                            "--append-eod", "--workers", "2", "--no-progress"]) == 0
    from mpzero.data import build_tokenizer

    tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=str(tmp_path / "tok.model"))
    ds = IndexedDataset(str(tmp_path / "kjv_text_document"))
    assert ds.dtype == np.uint16 and len(ds) == 60
    for i in (0, 17, 59):
        assert ds[i][-1] == tok.eod and tok.detokenize(ds[i][:-1]) == texts[i]
