"""No silent substitution of a checkpoint's tokenizer (issue 42, item 3; mpzero/inference/run_tokenizer.py): every
tool that reads a checkpoint's tokenizer (generate.py, export_hf.py) checks the files it reads against the sha256
the checkpoint's meta.json records. A run trained with GPT-2 BPE tokenizer A; A's vocab.json and merges.txt then
replaced, at the paths the checkpoint records, by tokenizer B's (the same 512 tokens, other merges), or B's given
with --vocab-file/--merge-file: one line naming both, nothing written. The recorded files work as before."""

import os
import runpy
import shutil

import pytest

from tests.cli import ROOT, fuzz_outcome, main_capturing_stdout
from tests.distributed import run_ranks
from tests.test_tokenizer_identity import RUN, _paths, _short, made  # noqa: F401 - made: the fixture

TOOLS = os.path.join(ROOT, "tools")
READERS = {
    "generate.py": lambda ckpt, out: ("generate.py", ["--load", ckpt, "--prompt", "In the beginning",
                                                      "--max-new-tokens", "2", "--output", str(out / "g.txt")]),
    "export_hf.py": lambda ckpt, out: ("export_hf.py", ["--load", ckpt, "--output", str(out / "hf")]),
}


def _tool(script, argv):
    return fuzz_outcome(runpy.run_path(os.path.join(TOOLS, script))["main"], argv)


@pytest.fixture
def trained_with_a_copy_of_a(made, tmp_path):
    """(checkpoint, the directory of the tokenizer files it records: a copy of A's)."""
    tok = tmp_path / "tok"
    tok.mkdir()
    _, _, vocab, merges = _paths(made["a"][0])
    shutil.copy(vocab, tok / "vocab.json")
    shutil.copy(merges, tok / "merges.txt")
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tok / "vocab.json"), "--merge-file",
             str(tok / "merges.txt")]
    ckpt = tmp_path / "ckpt"
    run_ranks(1, main_capturing_stdout, RUN + flags + ["--data-path", made["a"][1], "--save", str(ckpt)])
    return str(ckpt), tok


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_replaced_tokenizer_file_is_refused_in_one_line(made, trained_with_a_copy_of_a, tmp_path, reader):
    ckpt, tok = trained_with_a_copy_of_a
    out = tmp_path / "out"
    out.mkdir()
    code, stderr = run_ranks(1, _tool, *READERS[reader](ckpt, out))[0]
    assert code == 0, stderr
    shutil.rmtree(out)
    out.mkdir()
    _, _, vocab_b, merges_b = _paths(made["b"][0])
    for given in ("replaced at the recorded paths", "given as flags"):
        script, argv = READERS[reader](ckpt, out)
        if given == "given as flags":
            argv += ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_b, "--merge-file", merges_b]
        else:
            shutil.copy(vocab_b, tok / "vocab.json")
            shutil.copy(merges_b, tok / "merges.txt")
        code, stderr = run_ranks(1, _tool, script, argv)[0]
        assert code == 2 and stderr.count("\n") == 1, (given, stderr)
        assert f"({_short(made['b'][0])}) is not the one checkpoint" in stderr, (given, stderr)
        assert f"was trained with ({_short(made['a'][0])})" in stderr, (given, stderr)
        assert os.listdir(out) == [], "nothing is written with another tokenizer"
