"""Same tokenizer, or say so: two GPT-2 BPE tokenizers of the same vocabulary size (512) trained on different
text, and the bundled corpus preprocessed with each. A checkpoint or a dataset made with one and used with the
other is refused in one line naming both, unless --finetune (checkpoints) or --override-tokenizer-check says it
is meant; a checkpoint from before the record, or of --mock-data, is treated as stated in tokenizer_identity.py."""

import hashlib
import json
import os
import runpy
import shutil

import pytest

from mpzero.checkpointing import latest_iteration
from mpzero.data import build_tokenizer, check_data_tokenizers, tokenizer_identity
from mpzero.errors import ConfigError
from tests.cli import ROOT, exit_code_and_stderr, main_capturing_stdout
from tests.distributed import run_ranks
from tests.trained_gpt import corpus_texts, gpt2_bpe_files

TOOLS = os.path.join(ROOT, "tools")
RUN = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
       "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3",
       "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--eval-iters", "0",
       "--split", "1"]


def _one(fn, *args):
    return run_ranks(1, fn, *args)[0]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """{"a"/"b": (tokenizer flags, the documents preprocessed with it)}: same vocabulary size, other merges."""
    base = tmp_path_factory.mktemp("tokenizers")
    docs = base / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_texts(200)))
    preprocess = runpy.run_path(os.path.join(TOOLS, "preprocess_data.py"))["main"]
    out = {}
    for name, skip in (("a", 0), ("b", 3000)):
        (base / name).mkdir()
        flags = gpt2_bpe_files(base / name, corpus_texts(3000, skip=skip))
        assert preprocess(["--input", str(docs), "--output-prefix", str(base / name / "kjv"), "--append-eod",
                           "--no-progress", *flags]) == 0
        out[name] = (flags, str(base / name / "kjv_text_document"))
    sizes = {build_tokenizer(*_paths(flags)).vocab_size for flags, _ in out.values()}
    assert sizes == {512}
    return out


def _paths(flags):
    named = dict(zip(flags[::2], flags[1::2]))
    return named["--tokenizer-type"], None, named.get("--vocab-file"), named.get("--merge-file")


def _record(flags):
    return tokenizer_identity(build_tokenizer(*_paths(flags)))


def _short(flags):
    return f"GPT2BPETokenizer sha256:{_record(flags)['sha256'][:12]}"


def _argv(made, tokenizer, data, *more):
    return RUN + list(made[tokenizer][0]) + ["--data-path", made[data][1], *more]


def _files(root):
    """Every file under `root` with its size and modification time: what a refused run must not change."""
    return {os.path.join(d, f): (os.stat(os.path.join(d, f)).st_size, os.stat(os.path.join(d, f)).st_mtime_ns)
            for d, _, names in os.walk(root) for f in names}


@pytest.fixture
def saved_a(made, tmp_path):
    """A run of 2 iterations with tokenizer A on data A, saved."""
    ckpt = tmp_path / "ckpt"
    _one(main_capturing_stdout, _argv(made, "a", "a", "--save", str(ckpt)))
    return str(ckpt)


def _meta(ckpt):
    with open(os.path.join(ckpt, f"iter_{latest_iteration(ckpt):07d}", "meta.json")) as f:
        return json.load(f)


def test_the_record_is_the_sha256_of_the_files(made):
    flags = made["a"][0]
    _, _, vocab, merges = _paths(flags)
    with open(vocab, "rb") as v, open(merges, "rb") as m:  # `cat vocab.json merges.txt | sha256sum`
        digest = hashlib.sha256(v.read() + m.read()).hexdigest()
    assert _record(flags) == {"type": "GPT2BPETokenizer", "sha256": digest, "vocab_size": 512}
    with open(made["a"][1] + ".tokenizer.json") as f:
        assert json.load(f)["tokenizer"] == _record(flags)


def test_a_checkpoint_records_its_tokenizer_and_its_datas(made, saved_a):
    record = _meta(saved_a)["tokenizer"]
    assert record == {**_record(made["a"][0]), "data": {made["a"][1]: _record(made["a"][0])}}


def test_resuming_with_another_tokenizer_of_the_same_size_is_refused_and_writes_nothing(made, saved_a, tmp_path):
    before = _files(tmp_path)
    code, stderr = _one(exit_code_and_stderr, _argv(made, "b", "b", "--load", saved_a, "--save", saved_a,
                                                    "--train-iters", "4"))
    assert code == 2 and stderr.count("\n") == 1 and stderr.startswith(f"error: checkpoint {saved_a}/iter_0000002 ")
    assert f"was trained with {_short(made['a'][0])}, this run has {_short(made['b'][0])}" in stderr
    assert "--finetune" in stderr and "--override-tokenizer-check" in stderr
    assert _files(tmp_path) == before


def test_the_same_tokenizer_resumes_without_a_word(made, saved_a):
    _, out = _one(main_capturing_stdout, _argv(made, "a", "a", "--load", saved_a, "--save", saved_a,
                                               "--train-iters", "4"))
    assert f"loaded checkpoint from {saved_a} at iteration 2" in out
    assert not [line for line in out.splitlines() if line.startswith("note:") and "tokeniz" in line.lower()]
    assert latest_iteration(saved_a) == 4


def test_finetune_or_the_override_trains_on_saying_so(made, saved_a, tmp_path):
    new = str(tmp_path / "finetuned")
    history, out = _one(main_capturing_stdout, _argv(made, "b", "b", "--load", saved_a, "--save", new,
                                                     "--finetune"))
    notes = [line for line in out.splitlines() if line.startswith("note:") and "tokeniz" in line.lower()]
    assert notes == [(f"note: --finetune: {saved_a}/iter_0000002 was trained with {_short(made['a'][0])}; its "
                      f"weights train on with this run's {_short(made['b'][0])}")]
    assert len(history["losses"]) == 2 and latest_iteration(new) == 2  # from iteration 0: a new run
    assert _meta(new)["tokenizer"]["sha256"] == _record(made["b"][0])["sha256"]
    _, out = _one(main_capturing_stdout, _argv(made, "b", "b", "--load", saved_a, "--save", saved_a,
                                               "--train-iters", "4", "--override-tokenizer-check"))
    notes = [line for line in out.splitlines() if line.startswith("note: --override-tokenizer-check")]
    assert notes == [(f"note: --override-tokenizer-check: resuming {saved_a}/iter_0000002, trained with "
                      f"{_short(made['a'][0])}, with {_short(made['b'][0])}")]
    assert latest_iteration(saved_a) == 4


def test_a_checkpoint_without_the_record_loads_with_a_note(made, saved_a):
    path = os.path.join(saved_a, "iter_0000002", "meta.json")
    meta = _meta(saved_a)
    del meta["tokenizer"]
    with open(path, "w") as f:
        json.dump(meta, f)
    _, out = _one(main_capturing_stdout, _argv(made, "b", "b", "--load", saved_a, "--save", saved_a,
                                               "--train-iters", "3"))
    assert out.count(" records no tokenizer ") == 1
    assert (f"note: {saved_a}/iter_0000002 records no tokenizer (saved before mpzero recorded it): not compared "
            f"with this run's {_short(made['b'][0])}") in out
    assert latest_iteration(saved_a) == 3


def test_a_damaged_record_is_one_line(made, saved_a):
    path = os.path.join(saved_a, "iter_0000002", "meta.json")
    meta = _meta(saved_a)
    meta["tokenizer"] = "GPT2BPETokenizer"
    with open(path, "w") as f:
        json.dump(meta, f)
    code, stderr = _one(exit_code_and_stderr, _argv(made, "a", "a", "--load", saved_a))
    assert code == 2 and stderr.count("\n") == 1 and "meta.json is damaged (its \"tokenizer\"" in stderr


def test_mock_data_records_no_tokenizer_and_is_not_another_tokenizers(made, tmp_path):
    mock = ["--mock-data", "--vocab-size", "512"]
    ckpt = str(tmp_path / "mock")
    _one(main_capturing_stdout, RUN + mock + ["--save", ckpt])
    assert _meta(ckpt)["tokenizer"] == {"type": None, "sha256": None, "vocab_size": 512, "data": {}}
    _one(main_capturing_stdout, RUN + mock + ["--load", ckpt, "--save", ckpt, "--train-iters", "3"])
    assert latest_iteration(ckpt) == 3
    code, stderr = _one(exit_code_and_stderr, _argv(made, "a", "a", "--load", ckpt, "--train-iters", "4"))
    assert code == 2 and stderr.count("\n") == 1
    assert f"was trained with no tokenizer (--mock-data, 512 ids), this run has {_short(made['a'][0])}" in stderr


@pytest.mark.parametrize("tp", [1, 2])
def test_data_made_with_another_tokenizer_is_refused_unless_overridden(made, tmp_path, tp):
    """At TP 2 rank 0 reads the record and hashes the .idx; both ranks stop with its line."""
    before = _files(os.path.dirname(made["a"][1]))
    layout = ["--tensor-model-parallel-size", str(tp)]
    results = run_ranks(tp, exit_code_and_stderr, _argv(made, "b", "a", "--save", str(tmp_path / "ckpt"), *layout))
    assert [code for code, _ in results] == [2] * tp
    stderr = results[0][1]
    assert stderr == (f"error: --data-path {made['a'][1]} was tokenized with {_short(made['a'][0])}, this run has "
                      f"{_short(made['b'][0])}: pass the tokenizer it was made with, preprocess it with this run's, "
                      f"or --override-tokenizer-check if this is intended\n")
    assert _files(os.path.dirname(made["a"][1])) == before and not os.listdir(tmp_path / "ckpt")
    _, out = run_ranks(tp, main_capturing_stdout, _argv(made, "b", "a", "--override-tokenizer-check",
                                                        "--data-cache-path", str(tmp_path / "cache"), *layout))[0]
    assert out.count("note: --override-tokenizer-check: ") == 1


def test_a_record_of_another_idx_is_ignored_with_a_note(made, tmp_path):
    """The prefix made again by a tool that writes no record: the old record describes another .idx."""
    prefix = str(tmp_path / "kjv_text_document")
    shutil.copy(made["a"][1] + ".tokenizer.json", prefix + ".tokenizer.json")
    for ext in (".bin", ".idx"):
        shutil.copy(made["b"][1] + ext, prefix + ext)  # other tokens, other sequence lengths
    records, notes = check_data_tokenizers([prefix], _record(made["b"][0]), override=False)
    assert records == {prefix: None} and len(notes) == 1 and "describes another kjv_text_document.idx" in notes[0]
    with open(prefix + ".tokenizer.json", "w") as f:
        f.write("{")
    with pytest.raises(ConfigError, match=r"kjv_text_document.tokenizer.json is unreadable \(not valid JSON\)"):
        check_data_tokenizers([prefix], _record(made["b"][0]), override=False)


def test_merging_keeps_the_common_record_and_refuses_different_tokenizers(made, tmp_path, capsys):
    merge = runpy.run_path(os.path.join(TOOLS, "merge_datasets.py"))["main"]
    out = str(tmp_path / "merged")
    assert merge(["--input", made["a"][1], made["a"][1], "--output-prefix", out]) == 0
    with open(out + ".tokenizer.json") as f:
        assert json.load(f)["tokenizer"] == _record(made["a"][0])
    capsys.readouterr()
    assert merge(["--input", made["a"][1], made["b"][1], "--output-prefix", str(tmp_path / "mixed")]) != 0
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1 and "their ids mean different text" in stderr
    assert not [name for name in os.listdir(tmp_path) if name.startswith("mixed")]
