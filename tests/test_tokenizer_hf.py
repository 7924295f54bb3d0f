"""HuggingFaceTokenizer (a local tokenizer.json, run by `tokenizers`) through the tools: trained by
tools/train_tokenizer.py, preprocessing equal to `tokenizers`' own encoding, its identity recorded and checked,
a GPT trained on it, generation decoding with it and the HF export loading it with transformers."""

import contextlib
import io
import json
import os
import runpy

import pytest

from mpzero.data import IndexedDataset, build_tokenizer, tokenizer_identity
from mpzero.errors import ConfigError
from tests.cli import ROOT, quiet_main
from tests.distributed import run_ranks
from tests.trained_gpt import corpus_texts

TOOLS = os.path.join(ROOT, "tools")
tool = {name: runpy.run_path(os.path.join(TOOLS, f"{name}.py"))["main"]
        for name in ("train_tokenizer", "preprocess_data", "generate", "export_hf")}


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """(directory, tokenizer dir, documents): a tokenizer.json trained on KJV sentences, the documents
    preprocessed with it, and a tiny GPT trained on them."""
    base = tmp_path_factory.mktemp("hf_tokenizer")
    texts = corpus_texts(600) + ["naïve café — 東京 🙂 \t tabs\nand lines"]
    (base / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert tool["train_tokenizer"](["--tokenizer-type", "HuggingFaceTokenizer", "--input", str(base / "docs.jsonl"),
                                    "--vocab-size", "400", "--output-prefix", str(base / "tok")]) == 0
    assert tool["preprocess_data"](["--input", str(base / "docs.jsonl"), "--output-prefix", str(base / "d"),
                                    "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                    str(base / "tok"), "--append-eod", "--workers", "2", "--no-progress"]) == 0
    run_ranks(1, quiet_main, ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
                              "--seq-length", "32", "--micro-batch-size", "4", "--train-iters", "4", "--lr", "1e-3",
                              "--data-path", str(base / "d_text_document"), "--split", "98,1,1",
                              "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(base / "tok"),
                              "--save", str(base / "ckpt"), "--eval-iters", "1", "--log-interval", "4"])
    return base, texts


def test_preprocessing_matches_the_tokenizers_encoding(hf_run):
    from tokenizers import Tokenizer

    base, texts = hf_run
    reference = Tokenizer.from_file(str(base / "tok" / "tokenizer.json"))
    eod = reference.token_to_id("<|endoftext|>")
    assert eod == 0 and reference.get_vocab_size() == 400
    ds = IndexedDataset(str(base / "d_text_document"))
    assert len(ds) == len(texts)
    for i, text in enumerate(texts):
        assert ds[i].tolist() == reference.encode(text, add_special_tokens=False).ids + [eod], i
    assert reference.decode(ds[len(texts) - 1].tolist()[:-1]) == texts[-1], "byte-level: any text round-trips"


def test_the_same_corpus_trains_the_same_tokenizer_bytes(hf_run, tmp_path):
    base, _ = hf_run
    assert tool["train_tokenizer"](["--tokenizer-type", "HuggingFaceTokenizer", "--input", str(base / "docs.jsonl"),
                                    "--vocab-size", "400", "--output-prefix", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (base / "tok" / "tokenizer.json").read_bytes()


def test_identity_is_the_tokenizer_json_and_another_is_refused(hf_run, tmp_path, capsys):
    base, _ = hf_run
    record = tokenizer_identity(build_tokenizer("HuggingFaceTokenizer", str(base / "tok")))
    assert record["type"] == "HuggingFaceTokenizer" and record["vocab_size"] == 400
    assert json.loads((base / "d_text_document.tokenizer.json").read_text())["tokenizer"] == record
    # another tokenizer.json of the same size: the data and the checkpoint are refused, each in one line
    assert tool["train_tokenizer"](["--tokenizer-type", "HuggingFaceTokenizer", "--input", str(base / "docs.jsonl"),
                                    "--vocab-size", "400", "--output-prefix", str(tmp_path / "other"),
                                    "--json-keys", "text"]) == 0
    data = json.loads((tmp_path / "other" / "tokenizer.json").read_text())
    data["model"]["vocab"] = {k: v for k, v in sorted(data["model"]["vocab"].items(), key=lambda kv: -kv[1])}
    (tmp_path / "other" / "tokenizer.json").write_text(json.dumps(data))  # same tokens, another file
    from tests.cli import exit_code_and_stderr
    code, stderr = run_ranks(1, exit_code_and_stderr, [
        "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
        "--micro-batch-size", "4", "--train-iters", "4", "--lr", "1e-3", "--data-path", str(base / "d_text_document"),
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "other")])[0]
    assert code == 2 and stderr.count("\n") == 1
    assert "was tokenized with HuggingFaceTokenizer sha256:" in stderr and "this run has HuggingFaceTokenizer" in stderr


def _generate(argv):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        results = tool["generate"](argv)  # the results, as printed
    return results, out.getvalue()


def test_generation_decodes_with_the_run_tokenizer(hf_run):
    from tokenizers import Tokenizer

    base, _ = hf_run
    results, out = run_ranks(1, _generate, ["--load", str(base / "ckpt"), "--prompt", "And God said", "--greedy",
                                            "--max-new-tokens", "8", "--output-format", "jsonl"])[0]
    result = json.loads(out.splitlines()[0])
    assert result == results[0]
    reference = Tokenizer.from_file(str(base / "tok" / "tokenizer.json"))
    assert result["prompt"] == "And God said"
    assert reference.decode(reference.encode("And God said").ids + result["tokens"]) == "And God said" + result["text"]


def test_export_writes_a_tokenizer_transformers_loads(hf_run, tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    base, texts = hf_run
    with contextlib.redirect_stdout(io.StringIO()):
        assert tool["export_hf"](["--load", str(base / "ckpt"), "--output", str(tmp_path / "hf")]) == 0
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    mine = build_tokenizer("HuggingFaceTokenizer", str(base / "tok"))
    for text in texts[:20] + texts[-1:]:
        assert tok(text, add_special_tokens=False)["input_ids"] == mine.tokenize(text)
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == mine.eod
    assert "HuggingFaceTokenizer" in (tmp_path / "hf" / "README.md").read_text()


def test_end_of_text_comes_from_tokenizer_config_or_the_known_names(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    def write(directory, specials, config=None):
        vocab = {"a": 0, "b": 1, **{s: 2 + i for i, s in enumerate(specials)}}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.add_special_tokens(specials)
        directory.mkdir()
        tok.save(str(directory / "tokenizer.json"))
        if config is not None:
            (directory / "tokenizer_config.json").write_text(json.dumps(config))
        return str(directory)

    llama3 = build_tokenizer("HuggingFaceTokenizer", write(tmp_path / "l3", ["<|begin_of_text|>", "<|end_of_text|>"]))
    assert (llama3.eod, llama3.eod_token, llama3.vocab_size) == (3, "<|end_of_text|>", 4)
    chat = write(tmp_path / "chat", ["</s>", "<|im_end|>"], {"eos_token": {"content": "<|im_end|>"}})
    assert build_tokenizer("HuggingFaceTokenizer", chat).eod == 3, "tokenizer_config.json's eos_token wins"
    assert len(tokenizer_identity(build_tokenizer("HuggingFaceTokenizer", chat))["sha256"]) == 64
    with pytest.raises(ConfigError, match="has no end-of-text token for end-of-document"):
        build_tokenizer("HuggingFaceTokenizer", write(tmp_path / "none", ["<pad>"]))
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(ConfigError, match="is not a Hugging Face tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "junk.json"))
    with pytest.raises(ConfigError, match="needs --tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer")
    with pytest.raises(ConfigError, match="does not exist"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "missing"))
