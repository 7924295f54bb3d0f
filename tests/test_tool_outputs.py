"""Nothing a user keeps is destroyed (issue 23, item 3): a tool's output never is, contains or lies inside a
checkpoint directory or the --load run (compared resolved: a symbolic link is no way around), `--overwrite`
replaces only an earlier output of the same tool, the tools' temporary and set-aside directories are fresh
names (never a user's `OUT.tmp` or `OUT.old`), and a sharded HF index may name only files inside --input.
Each refusal is one `error:` line, exit code 2, and every file is left as it was."""

import json
import os
import runpy

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.cli import ROOT, TINY, quiet_main, tool_result
from tests.distributed import run_ranks

TOOLS = os.path.join(ROOT, "tools")
checkpoint_util_main = runpy.run_path(os.path.join(TOOLS, "checkpoint_util.py"))["main"]
export_main = runpy.run_path(os.path.join(TOOLS, "export_hf.py"))["main"]
import_main = runpy.run_path(os.path.join(TOOLS, "import_hf.py"))["main"]
generate_main = runpy.run_path(os.path.join(TOOLS, "generate.py"))["main"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory with a checkpoint (iteration 2) and a Hugging Face export of it."""
    base = tmp_path_factory.mktemp("outputs")
    run_ranks(1, quiet_main, TINY + ["--eval-iters", "0", "--train-iters", "2", "--save", str(base / "run")])
    assert tool_result(export_main, ["--load", str(base / "run"), "--output", str(base / "hf")]) == (0, "")
    return base / "run", base / "hf"


def _snapshot(path):
    """{relative path: bytes} of every file under `path` (links not followed)."""
    out = {}
    for folder, _, names in os.walk(path):
        for name in names:
            full = os.path.join(folder, name)
            out[os.path.relpath(full, path)] = b"link" if os.path.islink(full) else open(full, "rb").read()
    return out


def _refused(main, argv, *kept, says=""):
    """The command is one error line (containing `says`), and every directory in `kept` is left byte for byte."""
    before = [_snapshot(k) for k in kept]
    code, stderr = tool_result(main, argv)
    assert code == 2 and stderr.startswith("error: ") and stderr.count("\n") == 1, stderr
    assert says in stderr, stderr
    assert [_snapshot(k) for k in kept] == before
    return stderr


@pytest.mark.parametrize("where,says", [
    (lambda run: run, "--output {out} is --load"),
    (lambda run: run / "iter_0000002", "lies inside --load"),
    (lambda run: run / "exported", "lies inside --load"),
    (lambda run: run.parent, "contains --load"),
])
def test_export_never_writes_over_into_or_around_the_run(run, where, says):
    out = where(run[0])
    _refused(export_main, ["--load", str(run[0]), "--output", str(out), "--overwrite"], run[0],
             says=says.format(out=out))


def test_export_refuses_a_link_to_the_run_and_any_other_checkpoint(run, tmp_path):
    os.symlink(run[0], tmp_path / "link")
    _refused(export_main, ["--load", str(run[0]), "--output", str(tmp_path / "link"), "--overwrite"], run[0],
             says="is --load")
    other = tmp_path / "other"
    run_ranks(1, quiet_main, TINY + ["--eval-iters", "0", "--train-iters", "1", "--save", str(other)])
    for out, says in ((other, "is the checkpoint directory"), (other / "hf", "lies inside the checkpoint"),
                      (tmp_path, "contains the checkpoint directory")):
        _refused(export_main, ["--load", str(run[0]), "--output", str(out), "--overwrite"], other, says=says)


def test_export_overwrite_replaces_only_an_earlier_export(run, tmp_path):
    out = tmp_path / "hf"
    for name in ("config.json", "notes.txt"):  # a user's directory that happens to hold a config.json
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_text("mine")
    _refused(export_main, ["--load", str(run[0]), "--output", str(out), "--overwrite"], out,
             says="is not an earlier output of tools/export_hf.py (it holds notes.txt)")
    (out / "notes.txt").unlink()
    (out / "README.md").write_text("# my model\n")
    _refused(export_main, ["--load", str(run[0]), "--output", str(out), "--overwrite"], out, says="README.md")
    earlier = tmp_path / "earlier"
    assert tool_result(export_main, ["--load", str(run[0]), "--output", str(earlier)]) == (0, "")
    _refused(export_main, ["--load", str(run[0]), "--output", str(earlier)], earlier, says="pass --overwrite")
    for kept in ("earlier.tmp", "earlier.old"):  # once deleted as the export's own scratch names
        (tmp_path / kept).mkdir()
        (tmp_path / kept / "precious").write_text("x")
    assert tool_result(export_main, ["--load", str(run[0]), "--output", str(earlier), "--overwrite"]) == (0, "")
    assert sorted(os.listdir(tmp_path)) == ["earlier", "earlier.old", "earlier.tmp", "hf"]
    assert (tmp_path / "earlier.tmp" / "precious").exists() and (tmp_path / "earlier.old" / "precious").exists()
    assert load_file(earlier / "model.safetensors").keys() == load_file(run[1] / "model.safetensors").keys()


def test_to_consolidated_replaces_only_its_own_file(run, tmp_path):
    mine = tmp_path / "mine.pt"
    torch.save({"model": {}, "meta": {}, "mine": 1}, mine)
    argv = ["to-consolidated", "--load", str(run[0]), "--output", str(mine)]
    _refused(checkpoint_util_main, argv, tmp_path, says="pass --overwrite")
    _refused(checkpoint_util_main, argv + ["--overwrite"], tmp_path, says="not a consolidated checkpoint")
    weights = tmp_path / "weights.pt"
    argv = ["to-consolidated", "--load", str(run[0]), "--output", str(weights)]
    assert tool_result(checkpoint_util_main, argv) == (0, "")
    assert tool_result(checkpoint_util_main, argv + ["--overwrite"]) == (0, "")
    _refused(checkpoint_util_main, ["to-consolidated", "--load", str(run[0]), "--output", str(run[0] / "w.pt")],
             run[0], says="lies inside --load")


def test_from_consolidated_never_saves_into_a_run_or_a_users_directory(run, tmp_path):
    weights = tmp_path / "w.pt"
    assert tool_result(checkpoint_util_main, ["to-consolidated", "--load", str(run[0]), "--output", str(weights)])[0] == 0
    other = tmp_path / "other"
    run_ranks(1, quiet_main, TINY + ["--eval-iters", "0", "--train-iters", "1", "--save", str(other)])
    back = ["from-consolidated", "--input", str(weights), "--save"]
    _refused(checkpoint_util_main, back + [str(other)], other, says="is the checkpoint directory")
    _refused(checkpoint_util_main, back + [str(other / "sub")], other, says="lies inside the checkpoint directory")
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "keep.txt").write_text("x")
    _refused(checkpoint_util_main, back + [str(tmp_path / "user")], tmp_path / "user", says="keep.txt")


def _sharded(run, tmp_path, names):
    """An HF directory whose index splits the export's weights into two shards named `names`."""
    source = tmp_path / "in"
    source.mkdir(parents=True)
    (source / "config.json").write_bytes((run[1] / "config.json").read_bytes())
    state = load_file(run[1] / "model.safetensors")
    keys = sorted(state)
    weight_map = {}
    for name, part in zip(names, (keys[:len(keys) // 2], keys[len(keys) // 2:])):
        target = source / name if not os.path.isabs(name) else name
        save_file({k: state[k] for k in part}, str(target))
        weight_map.update({k: name for k in part})
    (source / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return source


def test_import_reads_shards_named_inside_input_only(run, tmp_path):
    good = _sharded(run, tmp_path / "good", ["a.safetensors", "b.safetensors"])
    assert tool_result(import_main, ["--input", str(good), "--save", str(tmp_path / "ok")]) == (0, "")
    outside = tmp_path / "outside.safetensors"
    cases = {"dotdot": ["a.safetensors", "../outside.safetensors"], "absolute": ["a.safetensors", str(outside)]}
    for case, names in cases.items():
        (tmp_path / case).mkdir()
        source = _sharded(run, tmp_path / case, names)
        _refused(import_main, ["--input", str(source), "--save", str(tmp_path / case / "out")], source,
                 says="which is not a file inside")
        assert not (tmp_path / case / "out").exists()
    (tmp_path / "link").mkdir()
    source = _sharded(run, tmp_path / "link", ["a.safetensors", "b.safetensors"])
    os.replace(source / "b.safetensors", outside)
    os.symlink(outside, source / "b.safetensors")
    _refused(import_main, ["--input", str(source), "--save", str(tmp_path / "link" / "out")], source,
             says="'b.safetensors', which is not a file inside")


def test_import_keeps_a_users_save_tmp_and_refuses_a_save_inside_a_checkpoint(run, tmp_path):
    (tmp_path / "ckpt.tmp").mkdir()
    (tmp_path / "ckpt.tmp" / "precious").write_text("x")
    assert tool_result(import_main, ["--input", str(run[1]), "--save", str(tmp_path / "ckpt")]) == (0, "")
    assert (tmp_path / "ckpt.tmp" / "precious").exists()
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ckpt.tmp"]
    _refused(import_main, ["--input", str(run[1]), "--save", str(run[0] / "imported")], run[0],
             says="lies inside the checkpoint directory")


def _generate(argv):
    return tool_result(generate_main, argv)


def test_generate_never_writes_into_the_run(run):
    before = _snapshot(run[0])
    code, stderr = run_ranks(1, _generate, ["--load", str(run[0]), "--prompt", "1 2", "--max-new-tokens", "1",
                                            "--tokenizer-type", "NullTokenizer",
                                            "--output", str(run[0] / "iter_0000002" / "meta.json")])[0]
    assert code == 2 and stderr.count("\n") == 1 and "lies inside --load" in stderr, stderr
    assert _snapshot(run[0]) == before


def test_every_output_gets_its_missing_parent_directories_and_an_existing_one_is_still_refused(run, tmp_path):
    ckpt, hf = run
    new = tmp_path / "a" / "b"
    assert tool_result(export_main, ["--load", str(ckpt), "--output", str(new / "hf")]) == (0, "")
    assert tool_result(import_main, ["--input", str(hf), "--save", str(new / "imported")])[0] == 0
    assert tool_result(checkpoint_util_main, ["to-consolidated", "--load", str(ckpt), "--output",
                                              str(new / "c" / "w.pt")]) == (0, "")
    assert tool_result(checkpoint_util_main, ["from-consolidated", "--input", str(new / "c" / "w.pt"), "--save",
                                              str(new / "d" / "ckpt")]) == (0, "")
    assert tool_result(generate_main, ["--load", str(ckpt), "--prompt", "", "--max-new-tokens", "2", "--output",
                                       str(new / "e" / "out.txt")])[1] == ""  # its main returns the samples
    for path in ("hf/config.json", "imported/latest_checkpointed_iteration.txt", "c/w.pt",
                 "d/ckpt/latest_checkpointed_iteration.txt", "e/out.txt"):
        assert (new / path).is_file(), path
    _refused(export_main, ["--load", str(ckpt), "--output", str(new / "hf")], new / "hf", says="already exists")
    _refused(import_main, ["--input", str(hf), "--save", str(new / "imported")], new / "imported",
             says="already exists")


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_the_files_a_tool_writes_share_the_mode_the_umask_gives(run, tmp_path, umask):
    ckpt, _ = run
    before = os.umask(umask)
    try:
        assert tool_result(export_main, ["--load", str(ckpt), "--output", str(tmp_path / "hf")]) == (0, "")
    finally:
        os.umask(before)
    modes = {name: os.stat(tmp_path / "hf" / name).st_mode & 0o777 for name in os.listdir(tmp_path / "hf")}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~umask}, modes


@pytest.mark.parametrize("model", [{"w": "a string"}, {"w": 3}, {"w": torch.zeros(2, dtype=torch.int64)},
                                   {7: torch.zeros(2)}, {"w": [torch.zeros(2)]}])
def test_from_consolidated_refuses_a_bundle_holding_what_is_no_weight_in_one_line(tmp_path, model):
    bundle = tmp_path / "w.pt"
    torch.save({"model": model, "meta": {}}, bundle)
    _refused(checkpoint_util_main, ["from-consolidated", "--input", str(bundle), "--save", str(tmp_path / "ckpt")],
             tmp_path, says="not a tensor of weights")
