"""Files that are not ours run no code (issue 23, item 1): a payload planted in each file a checkpoint holds
(DCP's .metadata, a .distcp shard, meta.json, the latest pointer, a checksum file, an RNG file) through every
reader (pretrain_gpt.py --load, checkpoint_util.py verify and to-consolidated, export_hf.py, generate.py) is one
`error:` line naming the file, a non-zero exit, and the payload never runs (its marker file stays absent)."""

import io
import os
import pickle
import runpy
import shutil

import pytest
import torch

from mpzero.checkpointing.reader import ADMITTED, load_metadata, read_metadata
from tests.cli import ROOT, TINY, exit_code_and_stderr, quiet_main, tool_result
from tests.distributed import run_ranks

TOOLS = os.path.join(ROOT, "tools")
checkpoint_util_main = runpy.run_path(os.path.join(TOOLS, "checkpoint_util.py"))["main"]
export_main = runpy.run_path(os.path.join(TOOLS, "export_hf.py"))["main"]
generate_main = runpy.run_path(os.path.join(TOOLS, "generate.py"))["main"]
ITERATION = "iter_0000002"


class _RunsAShell:
    """Unpickling it runs `touch MARKER` (pickle stores the call os.system(...), not this class)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _Importable:
    """A class that exists and does nothing when built, but is not checkpoint metadata."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("untrusted") / "ckpt"
    run_ranks(1, quiet_main, TINY + ["--eval-iters", "0", "--train-iters", "2", "--save", str(root)])
    return root


def _plant_in_metadata(directory, payload):
    """A genuine Metadata carrying the payload where DCP keeps free-form data (planner_data)."""
    metadata = read_metadata(directory)
    metadata.planner_data = payload
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))


def _plant_in_shard(directory, payload):
    """Every stored chunk points at a torch.save of the payload, the whole shard file."""
    blob = io.BytesIO()
    torch.save(payload, blob)
    (directory / "__0_0.distcp").write_bytes(blob.getvalue())
    metadata = read_metadata(directory)
    for info in metadata.storage_data.values():
        info.offset, info.length = 0, len(blob.getvalue())
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))


def _plant(root, kind, marker):
    """Plant a payload in the file `kind` of the checkpoint under `root`; returns the name the error must say."""
    directory = root / ITERATION
    evil = _RunsAShell(marker)
    if kind == "metadata":
        _plant_in_metadata(directory, evil)
        return ".metadata"
    if kind == "metadata-foreign-class":
        _plant_in_metadata(directory, _Importable())
        return ".metadata"
    if kind == "shard":
        _plant_in_shard(directory, evil)
        return "__0_0.distcp"
    if kind == "rng":
        torch.save(evil, directory / "rng" / "rank_00000.pt")
        return "rng/rank_00000.pt"
    path = {"meta": directory / "meta.json", "checksums": directory / "checksums" / "rank_00000.json",
            "latest": root / "latest_checkpointed_iteration.txt"}[kind]
    path.write_bytes(pickle.dumps(evil))
    return path.name


def _generate(argv):
    return tool_result(generate_main, argv)


ENTRY_POINTS = {
    "pretrain_gpt --load": lambda root, out: run_ranks(1, exit_code_and_stderr, TINY + [
        "--eval-iters", "0", "--train-iters", "3", "--load", str(root)])[0],
    "checkpoint_util verify": lambda root, out: tool_result(checkpoint_util_main, ["verify", "--load", str(root)]),
    "checkpoint_util to-consolidated": lambda root, out: tool_result(checkpoint_util_main, [
        "to-consolidated", "--load", str(root), "--output", str(out / "weights.pt")]),
    "export_hf": lambda root, out: tool_result(export_main, ["--load", str(root), "--output", str(out / "hf")]),
    "generate": lambda root, out: run_ranks(1, _generate, [
        "--load", str(root), "--prompt", "1 2 3", "--max-new-tokens", "2", "--tokenizer-type", "NullTokenizer"])[0],
}
KINDS = ("metadata", "metadata-foreign-class", "shard", "meta", "latest", "checksums", "rng")
READS_RNG = ("pretrain_gpt --load", "checkpoint_util verify")  # the others read only the weights


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("kind", KINDS)
def test_a_payload_in_any_checkpoint_file_runs_nothing_and_is_one_line(saved, tmp_path, kind, entry):
    if kind == "rng" and entry not in READS_RNG:
        pytest.skip(f"{entry} does not read RNG files")
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    marker = tmp_path / "payload-ran"
    name = _plant(root, kind, marker)
    out = tmp_path / "out"
    out.mkdir()
    code, stderr = ENTRY_POINTS[entry](root, out)
    assert not marker.exists(), f"{entry} ran the payload planted in {name}"
    assert code != 0 and stderr.startswith("error: ") and stderr.count("\n") == 1, stderr
    assert "Traceback" not in stderr and name in stderr, stderr
    assert os.listdir(out) == [], "nothing is written from a refused checkpoint"


def test_the_refusal_names_the_foreign_callable(saved, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    _plant(root, "metadata", tmp_path / "payload-ran")
    code, stderr = tool_result(checkpoint_util_main, ["verify", "--load", str(root)])
    assert code == 2 and "names posix.system, which is not checkpoint metadata" in stderr, stderr
    assert not (tmp_path / "payload-ran").exists()


def test_the_admitted_classes_are_the_ones_real_checkpoints_name(saved):
    """Every name a real checkpoint's .metadata pickles (recorded while unpickling) is admitted, and the admitted
    list holds nothing that can do more than build a value (no builtins beyond containers, no os, no eval)."""
    named = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            named.add((module, name))
            return super().find_class(module, name)

    with open(saved / ITERATION / ".metadata", "rb") as f:
        Recording(f).load()
    dtypes = {(m, n) for m, n in named if m == "torch" and isinstance(getattr(torch, n), torch.dtype)}
    assert named - dtypes <= ADMITTED, named - dtypes - ADMITTED
    assert {m for m, _ in ADMITTED} <= {"torch", "torch.serialization", "torch.distributed.checkpoint.metadata",
                                        "torch.distributed.checkpoint.filesystem", "pathlib", "collections",
                                        "builtins"}
    assert {n for m, n in ADMITTED if m == "builtins"} <= {"set", "frozenset"}


@pytest.mark.parametrize("damage", ["bytearray", "count", "buffer"])
def test_a_damaged_count_allocates_nothing_and_prints_nothing(damage, capfd):
    """A BYTEARRAY8 claiming exabytes made CPython's unpickler fail allocating and print a SystemError past the
    caller (1 in ~800 random files); counts are read before anything is built, and buffers are never admitted."""
    huge = (1 << 62).to_bytes(8, "little")
    data = {"bytearray": b"\x80\x05\x96" + huge + b"ab.", "count": b"\x80\x04\x8e" + huge + b"ab.",
            "buffer": b"\x80\x05\x96" + (2).to_bytes(8, "little") + b"ab\x98."}[damage]
    with pytest.raises(pickle.UnpicklingError, match="damaged|metadata never does"):
        load_metadata(io.BytesIO(data))
    assert capfd.readouterr().err == ""
