"""Every reader of a directory, given one with symbolic-link cycles and a second name for a subdirectory (issue 42,
item 2): the readers that walk a directory (tools/preprocess_data.py and tools/train_tokenizer.py --input DIR or a
`**` glob, through mpzero.data.parquet.expand_inputs) read each file once by its real path and refuse a cycle in
one line within seconds; the readers that list one level (merge_datasets.py --input DIR) take a linked dataset
once; the readers that open named files only (--load of every checkpoint reader, import_hf.py --input) are not
led anywhere by the links. The entry points are those of tests/test_fuzz_flags.py whose flag takes a directory
(a Path("dir") that must exist, or an --input that may be one): a new one fails here until it has a case."""

import json
import os
import runpy
import shutil
import time

import pytest

from tests.cli import ROOT, TINY, fuzz_outcome, quiet_main, tool_result
from tests.distributed import run_ranks

TOOLS = os.path.join(ROOT, "tools")


def _main(script):
    return runpy.run_path(os.path.join(ROOT, script))["main"]


@pytest.fixture(scope="module")
def trees(tmp_path_factory, request):
    """A parquet corpus (two files under snapshot/, `latest -> snapshot`), a dataset directory, a checkpoint and a
    Hugging Face export: each with a link back to a directory above it, and the corpus with a second cycle."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    base = tmp_path_factory.mktemp("cycles")
    corpus = base / "corpus"
    for k, part in enumerate(("a", "b")):
        (corpus / "snapshot" / part).mkdir(parents=True)
        pq.write_table(pa.table({"text": [f"{k} 1 2 3", f"{k} 4 5"]}), corpus / "snapshot" / part / "x.parquet")
    os.symlink("snapshot", corpus / "latest")
    ids = base / "ids.jsonl"
    ids.write_text("".join(json.dumps({"text": " ".join(str(k + i) for i in range(20))}) + "\n" for k in range(8)))
    data = base / "datasets"
    data.mkdir()
    assert tool_result(_main("tools/preprocess_data.py"), ["--input", str(ids), "--output-prefix", str(data / "d"),
                                                           "--tokenizer-type", "NullTokenizer", "--vocab-size", "299",
                                                           "--no-progress"])[0] == 0
    for ext in (".bin", ".idx"):
        os.symlink(f"d_text_document{ext}", data / f"latest{ext}")
    ckpt = base / "ckpt"
    run_ranks(1, quiet_main, TINY + ["--eval-iters", "0", "--train-iters", "2", "--save", str(ckpt)])
    assert tool_result(_main("tools/export_hf.py"), ["--load", str(ckpt), "--output", str(base / "hf")]) == (0, "")
    linked = [corpus / "snapshot" / "a", data, ckpt / "iter_0000002", base / "hf"]
    try:  # megatron-core's own checkpoint (conftest.py), copied: its iteration gets the link too
        megatron, _ = request.getfixturevalue("megatron_checkpoint")
        shutil.copytree(megatron, base / "megatron")
        linked.append(base / "megatron" / "iter_0000010")
    except pytest.skip.Exception:
        pass
    for directory in linked:
        os.symlink("..", directory / "up")
    return base


def _cycle_refused(code, stderr):
    return code == 2 and stderr.count("\n") == 1 and "a cycle of symbolic links" in stderr


def _succeeded(code, stderr):
    return code in (0, None) and "Traceback" not in stderr


# (script, argv given the trees and an output directory, what must happen)
CASES = {
    "preprocess_data.py --input DIR": ("tools/preprocess_data.py", lambda t, o: [
        "--input", str(t / "corpus"), "--output-prefix", str(o / "p"), "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "299", "--no-progress"], _cycle_refused),
    "preprocess_data.py --input DIR/**": ("tools/preprocess_data.py", lambda t, o: [
        "--input", str(t / "corpus" / "**" / "*.parquet"), "--output-prefix", str(o / "p"), "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "299", "--no-progress"], _cycle_refused),
    "train_tokenizer.py --input DIR": ("tools/train_tokenizer.py", lambda t, o: [
        "--input", str(t / "corpus"), "--vocab-size", "300", "--output-prefix", str(o / "sp")], _cycle_refused),
    "train_tokenizer.py HuggingFaceTokenizer --input DIR": ("tools/train_tokenizer.py", lambda t, o: [
        "--input", str(t / "corpus"), "--vocab-size", "300", "--output-prefix", str(o / "hf"), "--tokenizer-type",
        "HuggingFaceTokenizer"], _cycle_refused),
    "merge_datasets.py --input DIR": ("tools/merge_datasets.py", lambda t, o: [
        "--input", str(t / "datasets"), "--output-prefix", str(o / "m")], _succeeded),
    "import_hf.py --input DIR": ("tools/import_hf.py", lambda t, o: [
        "--input", str(t / "hf"), "--save", str(o / "imported")], _succeeded),
    "export_hf.py --load DIR": ("tools/export_hf.py", lambda t, o: [
        "--load", str(t / "ckpt"), "--output", str(o / "hf")], _succeeded),
    "checkpoint_util.py verify --load DIR": ("tools/checkpoint_util.py", lambda t, o: [
        "verify", "--load", str(t / "ckpt")], _succeeded),
    "checkpoint_util.py to-consolidated --load DIR": ("tools/checkpoint_util.py", lambda t, o: [
        "to-consolidated", "--load", str(t / "ckpt"), "--output", str(o / "w.pt")], _succeeded),
    "generate.py --load DIR": ("tools/generate.py", lambda t, o: [
        "--load", str(t / "ckpt"), "--prompt", "1 2", "--max-new-tokens", "1", "--tokenizer-type",
        "NullTokenizer"], _succeeded),
    "import_megatron.py --load DIR": ("tools/import_megatron.py", lambda t, o: [
        "--load", str(t / "megatron"), "--save", str(o / "imported"), "--num-attention-heads", "4",
        "--position-embedding-type", "rope", "--max-position-embeddings", "32", "--rotary-base", "500000",
        "--norm-epsilon", "1e-6", "--vocab-size", "100"], _succeeded),
    "pretrain_gpt.py --load DIR": ("pretrain_gpt.py", lambda t, o: TINY + [
        "--eval-iters", "0", "--train-iters", "3", "--load", str(t / "ckpt"), "--save", str(o / "s")], _succeeded),
}


def _run(script, argv):
    start = time.monotonic()
    code, stderr = fuzz_outcome(_main(script), argv)
    return code, stderr, time.monotonic() - start


def test_every_directory_reader_has_a_case():
    from tests.test_fuzz_flags import _entry_points
    readers = set()
    for name, _, _, parser in _entry_points():
        for action in parser._actions:
            kind = action.type
            takes_directory = getattr(kind, "kind", None) == "dir" and getattr(kind, "exists", False)
            if takes_directory or (action.dest == "input" and action.nargs == "+"):
                readers.add(f"{os.path.basename(name.split()[0])}{' ' + name.split()[1] if ' ' in name else ''} "
                            f"{action.option_strings[0]}")
    covered = {" ".join(w for w in case.split() if not w[0].isupper() and w != "HuggingFaceTokenizer")
               for case in CASES}
    assert readers <= covered, f"give these directory readers a case: {readers - covered}"
    print(f"directory readers: {len(readers)} found, {len(CASES)} cases")


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_directory_with_link_cycles_is_read_once_or_refused_in_one_line(trees, tmp_path, case):
    script, argv_of, expected = CASES[case]
    if "megatron" in case and not (trees / "megatron").exists():
        pytest.skip("megatron-core is not installed: no checkpoint of it to read")
    code, stderr, seconds = run_ranks(1, _run, script, argv_of(trees, tmp_path))[0]
    assert expected(code, stderr), f"{case}: exit {code}: {stderr}"
    assert seconds < 30, f"{case}: {seconds:.0f} s"


def test_without_the_cycles_each_file_is_read_once_by_its_real_path(trees, tmp_path):
    corpus = tmp_path / "corpus"
    shutil.copytree(trees / "corpus", corpus, symlinks=True)
    os.remove(corpus / "snapshot" / "a" / "up")
    for inputs in ([str(corpus)], [str(corpus / "**" / "*.parquet")], [str(corpus), str(corpus / "latest")]):
        code, stderr, _ = run_ranks(1, _run, "tools/preprocess_data.py", [
            "--input", *inputs, "--output-prefix", str(tmp_path / "p"), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "299", "--no-progress"])[0]
        assert code == 0, stderr
        from mpzero.data.indexed_dataset import IndexedDataset
        assert IndexedDataset(str(tmp_path / "p_text_document")).num_documents == 4, inputs  # 2 files x 2 rows
    code, stderr, _ = run_ranks(1, _run, "tools/merge_datasets.py", [
        "--input", str(trees / "datasets"), "--output-prefix", str(tmp_path / "m")])[0]
    assert code == 0 and IndexedDataset(str(tmp_path / "m")).num_documents == 8, stderr  # not 16: latest is d
