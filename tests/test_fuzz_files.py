"""The files the entry points read, damaged every way a file gets damaged (issue 23, item 6): truncated, empty,
the wrong JSON type, not UTF-8, a key missing, a key of the wrong type, an unknown key. Each reader answers
with a non-zero exit and one `error:` line naming the file (or, for a key it needs, the key), no traceback,
nothing created. An extra key a reader may ignore is allowed to pass, but never with a traceback.

Files x readers: --config (YAML and JSON) through pretrain_gpt.py; a checkpoint's meta.json and latest pointer
through checkpoint_util.py verify and to-consolidated, export_hf.py, generate.py and pretrain_gpt.py --load;
a Hugging Face config.json through import_hf.py; a dataset's .idx through merge_datasets.py."""

import json
import os
import runpy
import shutil

import pytest

from mpzero.checkpointing import LATEST
from mpzero.checkpointing.checkpoint import META_KEYS, RESUME_KEYS
from tests.cli import ROOT, TINY, fuzz_outcome, quiet_main, tree_snapshot
from tests.distributed import run_ranks
from tests.test_data_indexed_dataset import write_dataset

TOOLS = os.path.join(ROOT, "tools")
MAINS = {name: runpy.run_path(os.path.join(TOOLS, f"{name}.py"))["main"]
         for name in ("checkpoint_util", "export_hf", "generate", "import_hf", "merge_datasets")}
NOT_UTF8 = b"{\"caf\xe9\": \xff}"




def _json_damages(valid: dict, keys=None) -> dict[str, bytes | None]:
    """name: the damaged file's bytes (None: the file removed)."""
    text = json.dumps(valid).encode()
    damages = {"truncated": text[: len(text) // 2], "empty": b"", "a list": b"[1, 2]", "null": b"null",
               "a string": b"\"meta\"", "not utf-8": NOT_UTF8, "missing": None}
    for key in keys if keys is not None else valid:
        damages[f"no {key}"] = json.dumps({k: v for k, v in valid.items() if k != key}).encode()
        for wrong in ("x", [1], True, -1, 1e400):
            if type(wrong) is not type(valid[key]) or wrong != valid[key]:
                damages[f"{key} = {wrong!r}"] = json.dumps({**valid, key: wrong}).encode()
    return damages


def _write(path, data: bytes | None) -> None:
    if os.path.exists(path):
        os.remove(path)
    if data is not None:
        with open(path, "wb") as f:
            f.write(data)


def _check(label, code, stderr, names, before, after, may_pass=False):
    lines = stderr.splitlines()
    assert "Traceback" not in stderr, f"{label}: {stderr}"
    if may_pass and code in (0, None):
        return
    assert code not in (0, None), f"{label}: accepted"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{label}: {stderr!r}"
    assert any(name in lines[0] for name in names), f"{label}: names none of {names}: {lines[0]}"
    assert after == before, f"{label}: created {after - before}"


# --config -------------------------------------------------------------------------------------------------------

CONFIG = {"num-layers": 2, "hidden-size": 32, "lr": 1e-3}
CONFIG_DAMAGES = {**_json_damages(CONFIG), "an unknown key": json.dumps({**CONFIG, "num-layer": 2}).encode(),
                  "64.0 for an int": b"{\"num-layers\": 64.0}", "a mapping for a number": b"{\"lr\": {\"a\": 1}}",
                  "yaml nan": b"lr: .nan\n", "yaml bool for an int": b"num-layers: yes\n", "yaml truncated": b"a: [1,\n"}
CONFIG_DAMAGES.pop("missing")  # a missing --config is a flag's bad value (tests/test_fuzz_flags.py)


@pytest.mark.parametrize("damage", sorted(CONFIG_DAMAGES))
def test_config_files(tmp_path, monkeypatch, damage):
    monkeypatch.chdir(tmp_path)
    path = str(tmp_path / ("run.yaml" if damage.startswith("yaml") else "run.json"))
    _write(path, CONFIG_DAMAGES[damage])
    argv = _without(TINY, "--num-layers", "--hidden-size", "--lr") + ["--config", path]
    if damage.startswith("no "):  # the key's flag is then required
        names = ["--" + damage[3:]]
    else:
        names = [path]
    before = tree_snapshot(tmp_path)
    code, stderr = fuzz_outcome(quiet_main, argv)
    _check(f"--config {damage}", code, stderr, names, before, tree_snapshot(tmp_path))


def _without(argv: list[str], *flags: str) -> list[str]:
    """argv less each of `flags` and its value."""
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token in flags:
            skip = True
        else:
            out.append(token)
    return out


# a checkpoint's meta.json and latest pointer -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-files") / "ckpt"
    run_ranks(1, quiet_main, TINY + ["--eval-iters", "0", "--train-iters", "2", "--save", str(root)])
    return root


READERS = {
    "verify": lambda load, out: (MAINS["checkpoint_util"], ["verify", "--load", load]),
    "to-consolidated": lambda load, out: (MAINS["checkpoint_util"],
                                          ["to-consolidated", "--load", load, "--output", os.path.join(out, "w.pt")]),
    "export_hf": lambda load, out: (MAINS["export_hf"], ["--load", load, "--output", os.path.join(out, "hf")]),
    "generate": lambda load, out: (MAINS["generate"], ["--load", load, "--prompt", "1 2", "--max-new-tokens", "1"]),
    "pretrain --load": lambda load, out: (quiet_main, TINY + ["--load", load, "--train-iters", "3"]),
}

LATEST_DAMAGES = {"empty": b"", "letters": b"abc", "negative": b"-1", "a float": b"2.0", "huge": b"1" * 400,
                  "odd digits": "\u0662".encode(), "another iteration": b"7", "not utf-8": b"\xff\xfe",
                  "two numbers": b"2\n2", "missing": None}


def _meta_damages(saved) -> dict:
    with open(saved / "iter_0000002" / "meta.json") as f:
        meta = json.load(f)
    damages = _json_damages(meta)
    damages["layout's world = 0"] = json.dumps({**meta, "layout": {**meta["layout"], "world": 0}}).encode()
    damages["a shape of -1"] = json.dumps({**meta, "shapes": {k: [-1] for k in meta["shapes"]}}).encode()
    damages["an unknown key"] = json.dumps({**meta, "written_by": "someone"}).encode()
    return damages


def _may_pass(reader: str, file: str, damage: str) -> bool:
    """A damage a reader may legitimately read through: an optional key's absence (META_KEYS: older formats lack
    it; resuming reads RESUME_KEYS too), an unknown key, a run resumed from no checkpoint at all."""
    if file == LATEST:
        return damage == "missing" and reader == "pretrain --load"
    if damage.startswith("no "):
        key = damage[3:]
        return not META_KEYS[key][1] and not (reader == "pretrain --load" and key in RESUME_KEYS)
    return damage == "an unknown key"


@pytest.mark.parametrize("reader", sorted(READERS))
def test_checkpoint_files(saved, tmp_path, monkeypatch, reader):
    monkeypatch.chdir(tmp_path)
    cases = [("meta.json", damage, data) for damage, data in _meta_damages(saved).items()]
    cases += [(LATEST, damage, data) for damage, data in LATEST_DAMAGES.items()]
    failures = []
    for file, damage, data in cases:
        load = tmp_path / "run"
        shutil.rmtree(load, ignore_errors=True)
        shutil.copytree(saved, load)
        target = load / (LATEST if file == LATEST else os.path.join("iter_0000002", "meta.json"))
        _write(str(target), data)
        out = tmp_path / "out"  # fresh: a damage read through may have written its output
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        before = tree_snapshot(tmp_path)
        main, argv = READERS[reader](str(load), str(out))
        code, stderr = fuzz_outcome(main, argv)
        names = [file, str(load)]
        try:
            _check(f"{reader}: {file} {damage}", code, stderr, names, before, tree_snapshot(tmp_path),
                   may_pass=_may_pass(reader, file, damage))
        except AssertionError as failure:
            failures.append(str(failure))
    assert not failures, f"{len(failures)} of {len(cases)}:\n" + "\n".join(failures)


# a Hugging Face config.json ---------------------------------------------------------------------------------------

HF_GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 16, "vocab_size": 300,
           "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new"}


def test_hf_config_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    failures = []
    damages = {**_json_damages(HF_GPT2), "an unknown key": json.dumps({**HF_GPT2, "n_layers_typo": 2}).encode()}
    for damage, data in damages.items():
        source = tmp_path / "hf"
        shutil.rmtree(source, ignore_errors=True)
        source.mkdir()
        _write(str(source / "config.json"), data)
        before = tree_snapshot(tmp_path)
        code, stderr = fuzz_outcome(MAINS["import_hf"], ["--input", str(source), "--save", str(tmp_path / "ckpt")])
        key = damage.split(" ")[1] if damage.startswith("no ") else damage.split(" = ")[0]
        try:  # every damage ends in one line; the unknown key and a complete config then miss the weights
            _check(f"config.json {damage}", code, stderr, ["config.json", key, str(source)],
                   before, tree_snapshot(tmp_path))
        except AssertionError as failure:
            failures.append(str(failure))
    assert not failures, f"{len(failures)} of {len(damages)}:\n" + "\n".join(failures)


# a dataset's index ------------------------------------------------------------------------------------------------

def test_index_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_dataset(str(tmp_path / "good"), [([1, 2, 3], [3]), ([4, 5], [2])])
    idx = (tmp_path / "good.idx").read_bytes()
    damages = {"truncated": idx[: len(idx) // 2], "empty": b"", "header only": idx[:9], "garbage": b"\x00" * 64,
               "another version": idx[:9] + b"\x02" + idx[10:], "counts beyond the file": idx[:18] + b"\xff" * 8
               + idx[26:], "missing": None}
    failures = []
    for damage, data in damages.items():
        shutil.copy(tmp_path / "good.bin", tmp_path / "bad.bin")
        _write(str(tmp_path / "bad.idx"), data)
        before = tree_snapshot(tmp_path)
        code, stderr = fuzz_outcome(MAINS["merge_datasets"], ["--input", str(tmp_path / "bad"), "--output-prefix",
                                                         str(tmp_path / "merged")])
        try:
            _check(f".idx {damage}", code, stderr, ["bad.idx", str(tmp_path / "bad")], before, tree_snapshot(tmp_path))
        except AssertionError as failure:
            failures.append(str(failure))
    assert not failures, "\n".join(failures)
