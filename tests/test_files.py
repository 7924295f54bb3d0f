"""mpzero/files.py, the one writer (issue 42, item 1): each of its ways to write, with a link planted at the target
and at every temporary name it draws (its random part made predictable here, as an attacker cannot), never
writes through the link; and a lint over mpzero/, tools/ and pretrain_gpt.py fails on any write that bypasses it
(a bare open(..., "w"), shutil.copy*, Path.write_*, a creating os.open without O_NOFOLLOW, a library writer
given a path), so code added later is held to it. Third-party writers that open names of their own are listed
with the reason nobody can plant at those names."""

import ast
import glob
import itertools
import os

import pytest

from mpzero import files
from tests.cli import ROOT

VICTIM_TEXT = b"the victim's own bytes\n"


@pytest.fixture
def predictable(monkeypatch):
    """The writer's random part as a known sequence, so a test can plant at each name it will draw."""
    counter = itertools.count()
    monkeypatch.setattr(files, "_token", lambda: f"{next(counter):016x}")
    return lambda k: f"{k:016x}"


def _write_file(target):
    files.write_atomically(target, "content")


def _atomic_open(target):
    with files.atomic_open(target, ".tmp-label") as f:
        f.write(b"content")


def _copy(target):
    source = os.path.join(os.path.dirname(target), "..", "source")
    with open(source, "wb") as f:
        f.write(b"content")
    files.copy_atomically(source, target)


def _published(target):
    f, name = files.open_beside(target, ".tmp-builder")
    with f:
        f.write(b"content")
    files.publish_file(name, target)


# name: (how it writes `target`, the temporary names it draws for `target` given the k-th token, is a directory)
WRITES = {
    "write_atomically": (_write_file, lambda t, k: f"{t}.tmp.{k}", False),
    "atomic_open": (_atomic_open, lambda t, k: f"{t}.tmp-label.{k}", False),
    "copy_atomically": (_copy, lambda t, k: f"{t}.tmp.{k}", False),
    "open_beside + publish_file": (_published, lambda t, k: f"{t}.tmp-builder.{k}", False),
    "directory_beside": (lambda t: files.directory_beside(t), lambda t, k: os.path.join(
        os.path.dirname(t), f".{os.path.basename(t)}.tmp-{k}"), True),
    "private_directory": (lambda t: files.private_directory(os.path.dirname(t), "trace"), lambda t, k: os.path.join(
        os.path.dirname(t), f".trace.{k}"), True),
}


def _victim(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "file").write_bytes(VICTIM_TEXT)
    return victim


def _victim_intact(victim):
    assert sorted(os.listdir(victim)) == ["file"], os.listdir(victim)
    assert (victim / "file").read_bytes() == VICTIM_TEXT


@pytest.mark.parametrize("link_to", ["an existing file", "a missing file", "a directory"])
@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_link_at_every_name_the_writer_draws_is_never_followed(tmp_path, predictable, write, link_to):
    victim = _victim(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    target = str(out / "target")
    how, drawn, is_directory = WRITES[write]
    destination = {"an existing file": victim / "file", "a missing file": victim / "new",
                   "a directory": victim}[link_to]
    planted = [drawn(target, predictable(k)) for k in range(5)] + ([] if is_directory else [target, target + ".tmp"])
    for name in planted:
        os.symlink(destination, name)
    how(target)
    _victim_intact(victim)
    if not is_directory:
        assert not os.path.islink(target) and open(target, "rb").read() == b"content"
    left = sorted(set(os.listdir(out)) - {os.path.basename(p) for p in planted})
    assert len(left) == (1 if is_directory else 0), left  # the new directory, or nothing but the target
    assert all(os.path.islink(p) for p in planted if p != target), "a planted link was replaced or removed"


def test_fresh_directory_removes_a_planted_link_and_makes_its_own(tmp_path):
    victim = _victim(tmp_path)
    for kind in ("link", "stale directory", "file"):
        path = tmp_path / "save" / "iter_0000002.tmp"
        path.parent.mkdir(exist_ok=True)
        if kind == "link":
            os.symlink(victim, path)
        elif kind == "file":
            path.write_text("left")
        else:
            (path / "rng").mkdir(parents=True)
        files.fresh_directory(str(path))
        assert path.is_dir() and not path.is_symlink() and os.listdir(path) == [], kind
        path.rmdir()
    _victim_intact(victim)


def test_a_failed_write_leaves_neither_target_nor_temporary(tmp_path):
    def fails(f):
        f.write(b"half")
        raise RuntimeError("disk full")
    with pytest.raises(RuntimeError):
        files.write_atomically(str(tmp_path / "target"), fails)
    assert os.listdir(tmp_path) == []


def test_a_killed_writers_temporaries_are_removed_only_by_their_exact_names(tmp_path):
    target = tmp_path / "latest.txt"
    for name in ("latest.txt.tmp.0123456789abcdef", "latest.txt.tmp.mine", "latest.txt.tmp.0123456789abcdeg",
                 "other.tmp.0123456789abcdef"):
        (tmp_path / name).write_text("x")
    files.remove_temporaries(str(target))
    assert sorted(os.listdir(tmp_path)) == ["latest.txt.tmp.0123456789abcdeg", "latest.txt.tmp.mine",
                                            "other.tmp.0123456789abcdef"]


# -- the lint: nothing writes a file except through mpzero/files.py -------------------------------------------

SOURCES = [os.path.join(ROOT, "pretrain_gpt.py")] + sorted(
    glob.glob(os.path.join(ROOT, "mpzero", "**", "*.py"), recursive=True)
    + glob.glob(os.path.join(ROOT, "tools", "*.py")))
WRITER = os.path.join(ROOT, "mpzero", "files.py")
SHUTIL_WRITES = {"copy", "copy2", "copyfile", "copytree", "move"}
ALWAYS_WRITES = {"write_text", "write_bytes", "save_file", "save_pretrained", "tofile", "savez", "savez_compressed"}
PATH_TARGET = {"torch.save": 1, "np.save": 0, "numpy.save": 0, "json.dump": 1, "pickle.dump": 1}  # the file's place
# Libraries that open names of their own; each entry says why nobody can plant a link where they write.
THIRD_PARTY_WRITERS = {
    ("mpzero/checkpointing/checkpoint.py", "save"): "DCP writes into iter_N.tmp, made by files.fresh_directory",
    ("mpzero/checkpointing/consolidated.py", "save"): "DCP writes into iter_0000000.tmp, made by fresh_directory",
    ("mpzero/training/profiling.py", "export_chrome_trace"): "into files.private_directory (0700, a random name)",
    ("mpzero/training/metrics.py", "SummaryWriter"): "its event file's name ends in files.random_suffix()",
    ("mpzero/training/metrics.py", "init"): "wandb writes under a run directory named with a random run id",
}
LIBRARY_WRITERS = {"export_chrome_trace", "SummaryWriter", "init"}


def _name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _dotted(node) -> str:
    return f"{_dotted(node.value)}.{node.attr}" if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _writing_mode(call: ast.Call) -> bool:
    mode = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"), None)
    if mode is None:
        return False
    if not isinstance(mode, ast.Constant):
        return True  # a mode decided at run time: cannot be shown to only read
    return any(c in mode.value for c in "wa+")  # "x" creates exclusively: never through a link


def _creating_os_open(call: ast.Call, tree: ast.AST, source: str) -> bool:
    """Whether the enclosing function (where its flags are put together) opens for writing without O_NOFOLLOW."""
    enclosing = [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and f.lineno <= call.lineno <= f.end_lineno]
    text = ast.get_source_segment(source, min(enclosing, key=lambda f: f.end_lineno - f.lineno)) if enclosing \
        else source
    return any(f in text for f in ("O_CREAT", "O_WRONLY", "O_RDWR")) and "O_NOFOLLOW" not in text


def _a_path(node) -> bool:
    """An argument that spells a path (not a file object the writer opened)."""
    return isinstance(node, (ast.Constant, ast.JoinedStr, ast.BinOp)) or (
        isinstance(node, ast.Call) and _dotted(node.func) in ("os.path.join", "str", "os.fspath"))


def bypasses(source: str, relative: str) -> list[str]:
    """'file:line what' for every write in `source` that does not go through mpzero/files.py."""
    tree, found = ast.parse(source), []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name, where = _name(node), f"{relative}:{node.lineno}"
        if name == "open" and _dotted(node.func) in ("open", "io.open", "builtins.open") and _writing_mode(node):
            found.append(f"{where} open(..., {ast.unparse(node.args[1]) if len(node.args) > 1 else 'mode=...'})")
        elif _dotted(node.func) == "os.open" and _creating_os_open(node, tree, source):
            found.append(f"{where} os.open creating without O_NOFOLLOW")
        elif name in ALWAYS_WRITES or (name in SHUTIL_WRITES and _dotted(node.func).startswith("shutil.")):
            found.append(f"{where} {name}(...)")
        elif _dotted(node.func) in PATH_TARGET and len(node.args) > PATH_TARGET[_dotted(node.func)] \
                and _a_path(node.args[PATH_TARGET[_dotted(node.func)]]):
            found.append(f"{where} {_dotted(node.func)}(a path)")
        elif name in LIBRARY_WRITERS | {"save"} and (relative, name) not in THIRD_PARTY_WRITERS and (
                name != "save" or any(k.arg == "checkpoint_id" for k in node.keywords)):
            found.append(f"{where} {name}(...): a library writing by a name of its own")
    return found


def test_no_file_is_written_except_through_the_one_writer():
    found = []
    for path in SOURCES:
        if path == WRITER:
            continue
        with open(path, encoding="utf-8") as f:
            found += bypasses(f.read(), os.path.relpath(path, ROOT))
    print(f"lint: {len(SOURCES) - 1} files, {len(THIRD_PARTY_WRITERS)} third-party writers listed with a reason")
    assert not found, ("write through mpzero/files.py (write_atomically, atomic_open, copy_atomically, open_beside), "
                       "or list a library's own writer in THIRD_PARTY_WRITERS with why its names cannot be "
                       "planted:\n" + "\n".join(found))


@pytest.mark.parametrize("code", [
    "open(p, 'w')", "open(p, mode='ab')", "open(p, 'r+')", "open(p, m)", "io.open(p, 'wb')",
    "shutil.copyfile(a, b)", "Path(p).write_text('x')", "torch.save(x, 'w.pt')", "np.save(os.path.join(d, 'a'), x)",
    "save_file(state, p)", "json.dump(x, p + '.json')", "def f():\n    os.open(p, os.O_WRONLY | os.O_CREAT)",
    "dcp.save(state, checkpoint_id=d)", "SummaryWriter(log_dir=d)", "a.tofile(p)",
])
def test_the_lint_catches_every_kind_of_bypass(code):
    assert bypasses(code, "mpzero/new_module.py"), code


@pytest.mark.parametrize("code", [
    "open(p)", "open(p, 'rb')", "open(p, 'x')", "torch.save(x, f)", "np.save(f, x)", "json.dump(x, f)",
    "def f():\n    os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)", "os.open(p, os.O_RDONLY)",
])
def test_the_lint_lets_reads_and_writes_into_files_the_writer_opened_pass(code):
    assert not bypasses(code, "mpzero/new_module.py"), code
