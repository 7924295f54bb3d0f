"""tools/import_megatron.py against checkpoints the real megatron-core writes on this CPU (tests/megatron_core.py):
a LLaMA-shaped GPT (RMSNorm, SwiGLU, RoPE theta 500000, 2 key/value groups, untied, no biases) saved at TP 2 x PP 2
imports with megatron-core's own logits at mpzero TP 1 and 2 (1e-5), and trains on through pretrain_gpt.main from
the loss of megatron-core's logits; a GPT-2-shaped one (LayerNorm, GELU, learned positions, biases, the output
tied to the embedding across the pipeline stages, norms under their own names, stored in bf16) imports with its
logits too, and so does a LLaMA with kv_channels 12 at hidden 32 / 4 heads (product).
Per-layer keys with the SwiGLU halves stored apart (`singleton_local_shards`) are the `product` case (the same
conversion, other key parsing). The run's common.pt
is never opened (a pickle that would run code is left untouched); every bad input is one `error:` line, exit
code 2, and nothing written."""

import contextlib
import importlib.util
import io
import os
import pickle
import runpy
import shutil

import pytest
import torch
import torch.nn.functional as F

from mpzero.checkpointing.reader import read_metadata
from mpzero.errors import ConfigError
from mpzero.inference.megatron import Plan
from mpzero.inference.megatron_files import MEGATRON_ADMITTED
from mpzero.training.mock_data import MockGPTDataset
from tests.cli import quiet_main, tool_result
from tests.distributed import run_ranks
from tests.trained_gpt import TOOLS, mpzero_logits
from tools.checkpoint_util import read_consolidated

# Found, not imported: megatron-core imports wandb, which makes temporary folders that only go at interpreter exit
# (the suite's temp folder must be empty when it ends); the ranks that use it import it.
if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)
from tests.megatron_core import GPT2, LLAMA, megatron_world  # noqa: E402

import_main = runpy.run_path(os.path.join(TOOLS, "import_megatron.py"))["main"]
VOCAB, SEQ, BATCH = 100, 16, 4  # the tokenizer's vocabulary: Megatron padded it to 128 rows
TOLERANCE = 1e-5
LLAMA_FLAGS = ["--num-attention-heads", "4", "--position-embedding-type", "rope", "--max-position-embeddings", "32",
               "--rotary-base", "500000", "--norm-epsilon", "1e-6", "--vocab-size", str(VOCAB)]


def _batch():
    """pretrain_gpt's first global batch of --mock-data (seed 1234): [BATCH, SEQ + 1] tokens."""
    return torch.stack([torch.from_numpy(MockGPTDataset(VOCAB, SEQ, 1234, BATCH)[i]["tokens"]) for i in range(BATCH)])


def _saved(tmp_path_factory, spec, name, **options):
    root = str(tmp_path_factory.mktemp(name) / "megatron")
    return root, megatron_world(spec, 2, 2, root, _batch()[:, :-1], **options)[..., :VOCAB]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _saved(tmp_path_factory, LLAMA, "llama")


def _import(argv):
    """The import's printed lines; it succeeds and says nothing on stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert import_main(argv) == 0, err.getvalue()
    assert err.getvalue() == ""
    return out.getvalue()


def _assert_megatron_logits(checkpoint, megatron_logits):
    for tp in (1, 2):
        ours = torch.stack(run_ranks(tp, mpzero_logits, checkpoint, _batch()[:, :-1].tolist(), tp)[0])
        torch.testing.assert_close(ours, megatron_logits, rtol=0, atol=TOLERANCE)


def test_a_tp2_pp2_llama_imports_with_megatron_cores_logits(llama, tmp_path):
    root, logits = llama
    marker = tmp_path / "ran"
    common = os.path.join(root, "iter_0000010", "common.pt")
    saved_common = open(common, "rb").read()
    try:  # a common.pt that runs code if unpickled: the import never opens it
        with open(common, "wb") as f:
            pickle.dump(_RunsCode(str(marker)), f)
        _import(["--load", root, "--save", str(tmp_path / "imported")] + LLAMA_FLAGS)
    finally:
        with open(common, "wb") as f:
            f.write(saved_common)
    assert not marker.exists()
    _assert_megatron_logits(str(tmp_path / "imported"), logits)


class _RunsCode:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_the_imported_llama_trains_on_at_tp2_from_megatron_cores_loss(llama, tmp_path):
    root, logits = llama
    out = _import(["--load", root, "--save", str(tmp_path / "imported")] + LLAMA_FLAGS)
    flags = out.split("pretrain_gpt.py ", 1)[1].split(" --seq-length N", 1)[0].split()  # the line it prints
    history = run_ranks(2, quiet_main, flags + [
        "--mock-data", "--vocab-size", str(VOCAB), "--seq-length", str(SEQ), "--micro-batch-size", "2",
        "--global-batch-size", str(BATCH), "--train-iters", "2", "--lr", "1e-3", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--eval-iters", "0", "--log-interval", "1", "--tensor-model-parallel-size", "2",
        "--save", str(tmp_path / "tuned")])[0]
    labels = _batch()[:, 1:]
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)).item()
    assert abs(history["losses"][0] - expected) <= TOLERANCE * expected, (history["losses"], expected)
    assert len(history["losses"]) == 2 and all(torch.isfinite(torch.tensor(history["losses"])))
    tuned = read_consolidated(str(tmp_path / "tuned"), None)
    assert tuned["meta"]["iteration"] == 2
    imported = read_consolidated(str(tmp_path / "imported"), None)["model"]
    assert not torch.equal(tuned["model"]["layers.0.attention.qkv.weight"], imported["layers.0.attention.qkv.weight"])


def test_a_tp2_pp2_gpt2_imports_with_megatron_cores_logits(tmp_path_factory, tmp_path):
    """LayerNorm, exact GELU, biases, learned positions, the output tied to the embedding across the stages (no
    output_layer stored), norms under input_layernorm / pre_mlp_layernorm, stored in bf16 (compared with
    megatron-core's fp32 forward of those weights)."""
    root, logits = _saved(tmp_path_factory, GPT2, "gpt2")
    out = _import(["--load", root, "--save", str(tmp_path / "imported"), "--num-attention-heads", "4",
                   "--vocab-size", str(VOCAB), "--normalization", "LayerNorm"])
    assert "parameters stored as bfloat16" in out and "fp32 master copies are not read" in out
    _assert_megatron_logits(str(tmp_path / "imported"), logits)


@pytest.mark.product
def test_per_layer_keys_and_stored_swiglu_halves_import(tmp_path_factory, tmp_path):
    """singleton_local_shards: decoder.layers.<i>.* one tensor per layer, linear_fc1 as weight_w and weight_v."""
    root, logits = _saved(tmp_path_factory, LLAMA, "singleton", sharded_metadata={"singleton_local_shards": True})
    names = read_metadata(os.path.join(root, "iter_0000010"), MEGATRON_ADMITTED).state_dict_metadata
    assert "decoder.layers.3.mlp.linear_fc1.weight_w" in names
    _import(["--load", root, "--save", str(tmp_path / "imported")] + LLAMA_FLAGS)
    _assert_megatron_logits(str(tmp_path / "imported"), logits)


@pytest.mark.product
def test_a_llama_with_its_own_head_size_imports_with_megatron_cores_logits(tmp_path_factory, tmp_path):
    """kv_channels 12 at hidden 32 / 4 heads (Qwen3's head_dim 128 at 2048 / 32): the import reads it from
    linear_proj's columns, prints --kv-channels 12, and computes megatron-core's logits."""
    spec = {**LLAMA, "config": {**LLAMA["config"], "kv_channels": 12}}
    root, logits = _saved(tmp_path_factory, spec, "kv")
    out = _import(["--load", root, "--save", str(tmp_path / "imported"), "--kv-channels", "12"] + LLAMA_FLAGS)
    assert "--kv-channels 12" in out
    _assert_megatron_logits(str(tmp_path / "imported"), logits)


def _without(flags, flag):
    i = flags.index(flag)
    return flags[:i] + flags[i + 2:]


@pytest.mark.parametrize("change,message", [
    (lambda f: _without(f, "--position-embedding-type"), "has no learned position embedding: pass "
                                                          "--position-embedding-type rope"),
    (lambda f: f + ["--num-attention-heads", "3"],
     "--num-attention-heads 3 does not divide the checkpoint's attention width 32"),
    (lambda f: f + ["--num-layers", "3"], "--num-layers 3 disagrees with the checkpoint's tensors, which say "
                                          "num_layers 4"),
    (lambda f: f + ["--normalization", "LayerNorm"], "--normalization LayerNorm disagrees"),
    (lambda f: f + ["--num-query-groups", "4"], "--num-query-groups 4 disagrees"),
    (lambda f: f + ["--kv-channels", "16"], "--kv-channels 16 disagrees with the checkpoint's tensors, which say "
                                            "kv_channels 8"),
    (lambda f: f + ["--vocab-size", "200"], "--vocab-size 200 is more than the checkpoint's 128 embedding rows"),
    (lambda f: _without(f, "--max-position-embeddings"), "--max-position-embeddings is needed with RoPE"),
    (lambda f: f + ["--ckpt-step", "5"], "has no iter_0000005 directory"),
    (lambda f: f + ["--apply-layernorm-1p"], "--apply-layernorm-1p: mpzero's GPT does not compute zero-centered"),
])
def test_bad_flags_are_one_line(llama, tmp_path, change, message):
    argv = change(["--load", llama[0], "--save", str(tmp_path / "out")] + LLAMA_FLAGS)
    code, err = tool_result(import_main, argv)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not os.listdir(tmp_path)


def _damage(directory, case):
    if case == "legacy":  # one pickle per model-parallel rank, no DCP files
        for name in os.listdir(directory):
            os.remove(os.path.join(directory, name))
        os.makedirs(os.path.join(directory, "mp_rank_00"))
        with open(os.path.join(directory, "mp_rank_00", "model_optim_rng.pt"), "wb") as f:
            pickle.dump(_RunsCode(os.path.join(directory, "ran")), f)
    elif case == "zarr":
        with open(os.path.join(directory, "metadata.json"), "w") as f:
            f.write('{"sharded_backend": "zarr", "sharded_backend_version": 1}')
    elif case == "foreign":
        with open(os.path.join(directory, ".metadata"), "wb") as f:
            pickle.dump(_RunsCode(os.path.join(directory, "ran")), f)
    elif case == "truncated":
        shard = os.path.join(directory, "__1_0.distcp")
        os.truncate(shard, os.path.getsize(shard) // 2)


@pytest.mark.parametrize("case,message", [
    ("legacy", "is in Megatron's legacy torch format"),
    ("zarr", "is in the 'zarr' format, not 'torch_dist': re-save it"),
    ("foreign", ".metadata is refused: it names io.open, which is not checkpoint metadata"),
    ("truncated", "__1_0.distcp is truncated"),
])
def test_damaged_or_foreign_checkpoints_are_one_line(llama, tmp_path, case, message):
    source = str(tmp_path / "iter_0000010")
    shutil.copytree(os.path.join(llama[0], "iter_0000010"), source)
    _damage(source, case)
    code, err = tool_result(import_main, ["--load", source, "--save", str(tmp_path / "out")] + LLAMA_FLAGS)
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(os.path.join(source, "ran"))


def test_parts_mpzero_has_not_are_refused_by_name(llama):
    metadata = read_metadata(os.path.join(llama[0], "iter_0000010"), MEGATRON_ADMITTED)
    stored = metadata.state_dict_metadata
    stored["decoder.layers.mlp.router.weight"] = stored["decoder.layers.mlp.linear_fc2.weight"]  # an MoE's router
    with pytest.raises(ConfigError, match="holds decoder.layers.mlp.router.weight, which mpzero's GPT has no part "
                                          "for .mixture-of-experts"):
        Plan(metadata, "--load x")


def test_an_existing_save_is_refused(llama, tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "keep.txt").write_text("x")
    code, err = tool_result(import_main, ["--load", llama[0], "--save", str(tmp_path / "used")] + LLAMA_FLAGS)
    assert code == 2 and "already exists and is not empty" in err and (tmp_path / "used" / "keep.txt").exists()
