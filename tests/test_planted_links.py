"""Every file every entry point writes, with a link planted at every name its writes use (issue 42, item 1).

Each entry point that writes (pretrain_gpt.py with --save, --data-cache-path, --tensorboard-dir and the
profiler's trace, and every writing tool and subcommand) runs twice in a forked process:
  1. recorded: mpzero/files.py's `os` is watched, so every temporary file it creates, every directory it makes
     and every name it renames onto is known, its random part made predictable (a counter). Every file the run
     leaves must be one of those names or lie in a directory renamed into place as a whole: a write that
     bypasses the writer fails here, so code added later is held to it.
  2. planted: the same run again (the same names drawn) with a link at each of those names whose directory
     exists: a dangling link into a victim directory at each file it renames onto, a link to the victim's file at
     each temporary name (and at the old fixed NAME.tmp), a link to the victim directory at each directory it
     makes. The victim stays untouched, and the run succeeds with plain files (or refuses in one line).
A new tool is found by construction (every script with a main) and must be given a scenario or be named
read-only here."""

import glob
import itertools
import json
import os
import pathlib
import runpy
import shutil

import pytest

from mpzero import files
from tests.cli import ROOT, TINY, fuzz_outcome, quiet_main, tool_result
from tests.distributed import run_ranks

TOOLS = os.path.join(ROOT, "tools")
READ_ONLY = {"tools/plan_memory.py": "prints a plan", "tools/compile_kernels.py": "fills Triton's own cache",
             "tools/checkpoint_util.py verify": "reads and checks a checkpoint"}
VICTIM_TEXT = b"the victim's own bytes\n"
RUN = [a for a in TINY if a != "--mock-data"] + ["--eval-iters", "0", "--train-iters", "2"]


class _WatchedOs:
    """mpzero/files.py's view of `os`: the names it creates, makes and renames onto, recorded."""

    def __init__(self, log):
        self._log = log

    def __getattr__(self, name):
        return getattr(os, name)

    def open(self, path, flags, *args, **kwargs):
        if flags & os.O_CREAT:
            self._log.append(("temporary", os.path.abspath(path)))
        return os.open(path, flags, *args, **kwargs)

    def mkdir(self, path, *args, **kwargs):
        self._log.append(("made", os.path.abspath(path)))
        return os.mkdir(path, *args, **kwargs)

    def replace(self, source, target):
        self._log.append(("final", os.path.abspath(target)))
        return os.replace(source, target)


def _watched_run(script, argv):
    """In a forked rank: (exit code, stderr, what the writer did) of `script`'s main(argv)."""
    main = runpy.run_path(os.path.join(ROOT, script))["main"]
    log, counter = [], itertools.count()
    files._token = lambda: f"{next(counter):016x}"
    files.os = _WatchedOs(log)
    code, stderr = fuzz_outcome(main, argv)
    return code, stderr, log


class _Sources(type(pathlib.Path())):  # the sources' folder, and the megatron-core checkpoint (from conftest.py)
    megatron = None


@pytest.fixture(scope="module")
def sources(tmp_path_factory, request):
    """Inputs every scenario reads (never written by them): a token-id corpus and its dataset, a text corpus,
    a checkpoint, its consolidated weights, its Hugging Face export, and a megatron-core checkpoint (the
    import_megatron scenario is skipped without megatron-core)."""
    src = _Sources(tmp_path_factory.mktemp("sources"))
    with open(src / "ids.jsonl", "w") as f:
        for k in range(40):
            f.write(json.dumps({"text": " ".join(str((k * 7 + i) % 250) for i in range(30))}) + "\n")
    words = ["in", "the", "beginning", "was", "word", "and", "light", "dark", "earth", "water", "heaven", "day"]
    with open(src / "text.jsonl", "w") as f:
        for k in range(300):
            f.write(json.dumps({"text": " ".join(words[(k * i + i) % len(words)] for i in range(1, 25))}) + "\n")
    preprocess = runpy.run_path(os.path.join(TOOLS, "preprocess_data.py"))["main"]
    assert tool_result(preprocess, ["--input", str(src / "ids.jsonl"), "--output-prefix", str(src / "data"),
                                    "--tokenizer-type", "NullTokenizer", "--vocab-size", "299",
                                    "--no-progress"])[0] == 0
    run_ranks(1, quiet_main, TINY + ["--eval-iters", "0", "--train-iters", "2", "--save", str(src / "ckpt")])
    util = runpy.run_path(os.path.join(TOOLS, "checkpoint_util.py"))["main"]
    assert tool_result(util, ["to-consolidated", "--load", str(src / "ckpt"), "--output", str(src / "w.pt")]) == (0, "")
    export = runpy.run_path(os.path.join(TOOLS, "export_hf.py"))["main"]
    assert tool_result(export, ["--load", str(src / "ckpt"), "--output", str(src / "hf")]) == (0, "")
    try:
        src.megatron = request.getfixturevalue("megatron_checkpoint")
    except pytest.skip.Exception:
        src.megatron = None
    return src


# name: (script, argv given the sources and the run's own directory)
SCENARIOS = {
    "pretrain_gpt.py": ("pretrain_gpt.py", lambda s, o: RUN + [
        "--data-path", str(s / "data_text_document"), "--tokenizer-type", "NullTokenizer", "--vocab-size", "299",
        "--split", "1,0,0", "--save", str(o / "save"), "--save-interval", "1", "--data-cache-path", str(o / "cache"),
        "--tensorboard-dir", str(o / "tb"), "--profile", "--use-pytorch-profiler", "--profile-step-start", "1",
        "--profile-step-end", "2"]),
    "tools/preprocess_data.py": ("tools/preprocess_data.py", lambda s, o: [
        "--input", str(s / "ids.jsonl"), "--output-prefix", str(o / "out"), "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "299", "--no-progress"]),
    "tools/merge_datasets.py": ("tools/merge_datasets.py", lambda s, o: [
        "--input", str(s / "data_text_document"), str(s / "data_text_document"), "--output-prefix",
        str(o / "merged")]),
    "tools/train_tokenizer.py": ("tools/train_tokenizer.py", lambda s, o: [
        "--input", str(s / "text.jsonl"), "--vocab-size", "300", "--output-prefix", str(o / "sp")]),
    "tools/train_tokenizer.py HuggingFaceTokenizer": ("tools/train_tokenizer.py", lambda s, o: [
        "--input", str(s / "text.jsonl"), "--vocab-size", "300", "--output-prefix", str(o / "hf_tok"),
        "--tokenizer-type", "HuggingFaceTokenizer"]),
    "tools/checkpoint_util.py to-consolidated": ("tools/checkpoint_util.py", lambda s, o: [
        "to-consolidated", "--load", str(s / "ckpt"), "--output", str(o / "w.pt")]),
    "tools/checkpoint_util.py from-consolidated": ("tools/checkpoint_util.py", lambda s, o: [
        "from-consolidated", "--input", str(s / "w.pt"), "--save", str(o / "back")]),
    "tools/export_hf.py": ("tools/export_hf.py", lambda s, o: [
        "--load", str(s / "ckpt"), "--output", str(o / "hf")]),
    "tools/import_hf.py": ("tools/import_hf.py", lambda s, o: ["--input", str(s / "hf"), "--save", str(o / "ckpt")]),
    "tools/import_megatron.py": ("tools/import_megatron.py", lambda s, o: [
        "--load", str(s.megatron[0]), "--save", str(o / "ckpt"), *s.megatron[1]]),
    "tools/generate.py": ("tools/generate.py", lambda s, o: [
        "--load", str(s / "ckpt"), "--prompt", "1 2", "--max-new-tokens", "2", "--tokenizer-type", "NullTokenizer",
        "--output", str(o / "generated.txt")]),
}
THIRD_PARTY = ("events.out.tfevents.",)  # TensorBoard's file: its name ends in files.random_suffix()


def test_every_entry_point_is_a_scenario_or_read_only():
    from tests.test_fuzz_flags import _entry_points  # every script with a main, and every subcommand
    named = {name for name, *_ in _entry_points()}
    covered = {name for name in SCENARIOS} | {script for script, _ in SCENARIOS.values()} | set(READ_ONLY)
    assert named - covered == set(), f"give these a scenario here, or say why they write nothing: {named - covered}"


def _tree(root) -> dict[str, str]:
    """{path: 'dir' | 'file' | 'link'} of everything under root."""
    out = {}
    for folder, dirs, names in os.walk(root):
        for name in dirs + names:
            path = os.path.join(folder, name)
            out[path] = "link" if os.path.islink(path) else "dir" if os.path.isdir(path) else "file"
    return out


def _accounted(path, finals, kind) -> bool:
    """A file the writer renamed into place, or inside a directory it renamed into place as a whole."""
    if kind == "dir" or os.path.basename(path).startswith(THIRD_PARTY):
        return True
    return any(path == final or path.startswith(final + os.sep) for final in finals)


def _victim(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "file").write_bytes(VICTIM_TEXT)
    return victim


def _plant(log, skeleton, victim, at_finals: bool) -> list[str]:
    """Links at the names the recorded run used whose directory exists now (and is no link): at the files it
    renamed onto (and the old fixed NAME.tmp), or at its temporary files and the directories it made."""
    planted = []
    for kind, path in log:
        parent = os.path.dirname(path)
        if path in planted or os.path.lexists(path) or not os.path.isdir(parent) or os.path.realpath(parent) != parent:
            continue  # taken, or in a directory the run makes (or one now a planted link)
        if at_finals and kind == "final" and skeleton.get(path) == "file":
            os.symlink(victim / f"final-{len(planted)}", path)
            os.symlink(victim / "file", path + ".tmp")  # the old writer's fixed temporary name
            planted += [path, path + ".tmp"]
        elif not at_finals and kind == "temporary":
            os.symlink(victim / "file" if len(planted) % 2 else victim / f"new-{len(planted)}", path)
            planted.append(path)
        elif not at_finals and kind == "made":
            os.symlink(victim, path)
            planted.append(path)
    return planted


def _fresh(out, after, log, finals):
    """`out` as the user's flags name it before the run: the directories they name (not the run's own) made
    empty again."""
    shutil.rmtree(out)
    out.mkdir()
    for path, kind in sorted(after.items()):
        if kind == "dir" and not any(path == f or path.startswith(f + os.sep) for f in finals) \
                and ("made", path) not in log:
            os.makedirs(path, exist_ok=True)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_no_write_of_any_entry_point_follows_a_link_planted_at_its_names(sources, tmp_path, scenario):
    script, argv_of = SCENARIOS[scenario]
    if "megatron" in scenario and sources.megatron is None:
        pytest.skip("megatron-core is not installed: no checkpoint of it to import")
    out = tmp_path / "out"
    out.mkdir()
    argv = argv_of(sources, out)
    code, stderr, log = run_ranks(1, _watched_run, script, argv)[0]
    assert code == 0 and "Traceback" not in stderr, stderr
    after = _tree(out)
    finals = {path for kind, path in log if kind == "final"}
    unaccounted = [p for p, kind in after.items() if not _accounted(p, finals, kind)]
    assert not unaccounted, f"{scenario} wrote files past mpzero/files.py: {unaccounted}"
    victim = _victim(tmp_path)
    counts = []
    for at_finals in (False, True):  # the same run again, a link at each name it used
        _fresh(out, after, log, finals)
        planted = _plant(log, after, victim, at_finals)
        code, stderr, _ = run_ranks(1, _watched_run, script, argv)[0]
        assert sorted(os.listdir(victim)) == ["file"] and (victim / "file").read_bytes() == VICTIM_TEXT, \
            f"{scenario} wrote through a planted link: {os.listdir(victim)}"
        assert "Traceback" not in stderr, stderr
        # a link at a name it draws: another name drawn; at its output: replaced; or one line refusing a directory
        # that holds what the tool did not write
        assert code == 0 or (stderr.startswith("error: ") and stderr.count("\n") == 1), stderr
        if code == 0:
            links = [p for p in finals if os.path.islink(p)]
            assert not links, f"{scenario} left links where its outputs belong: {links}"
        counts.append(f"{len(planted)} links planted, exit {code}")
    print(f"{scenario}: {len(log)} names used; at temporaries and made directories {counts[0]}; at outputs "
          f"{counts[1]}")
