"""tools/export_hf.py and tools/import_hf.py against transformers' GPT2LMHeadModel.

Checkpoints saved at TP 1 (GPT-2 BPE, tanh GELU, untied output) and at TP 2 x DP 2 under ZeRO-3 (SentencePiece,
erf GELU, tied) export to directories HF loads without a missing or unexpected key, whose logits on real text
match mpzero's at TP 1 and TP 2 (fp32: 1e-4, the issue's bound; the sums run in another order, ~3e-6 seen);
import -> export returns identical tensors; an imported model continues training at TP 2 from the same loss;
bad inputs are one line, exit code 2, nothing written.
"""

import contextlib
import glob
import io
import json
import os
import runpy

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, GPT2LMHeadModel

from mpzero.data import build_tokenizer
from mpzero.training.mock_data import MockGPTDataset
from tests.cli import quiet_main
from tests.distributed import run_ranks
from tests.trained_gpt import MODEL, TOOLS, mpzero_logits, runs
from tools.checkpoint_util import read_consolidated, save_weights_only

export_main = runpy.run_path(os.path.join(TOOLS, "export_hf.py"))["main"]
import_main = runpy.run_path(os.path.join(TOOLS, "import_hf.py"))["main"]
LOGIT_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return runs(tmp_path_factory)


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    base = tmp_path_factory.mktemp("exported")
    out = {}
    for name in ("bpe", "sp"):
        out[name] = str(base / name)
        assert export_main(["--load", getattr(trained, name).checkpoint, "--output", out[name]]) == 0
    return out


def _hf_model(directory):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        model, info = GPT2LMHeadModel.from_pretrained(directory, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    assert not any(word in err.getvalue() for word in ("LOAD REPORT", "MISSING", "UNEXPECTED", "newly initialized"))
    return model.eval()


def _token_ids(trained, name):
    flags = dict(zip(getattr(trained, name).tokenizer_flags[::2], getattr(trained, name).tokenizer_flags[1::2]))
    tokenizer = build_tokenizer(flags["--tokenizer-type"], flags.get("--tokenizer-model"), flags.get("--vocab-file"),
                                flags.get("--merge-file"))
    return tokenizer, [tokenizer.tokenize(text)[:128] for text in trained.texts]


@pytest.mark.parametrize("name", ["bpe", "sp"])
def test_exported_logits_match_mpzero_at_tp1_and_tp2(trained, exported, name):
    hf = _hf_model(exported[name])
    _, id_lists = _token_ids(trained, name)
    assert sum(map(len, id_lists)) > 200
    with torch.no_grad():
        reference = [hf(torch.tensor([ids])).logits[0] for ids in id_lists]
    for tp in (1, 2):
        ours = run_ranks(tp, mpzero_logits, getattr(trained, name).checkpoint, id_lists, tp)[0]
        for a, b in zip(ours, reference):
            assert (a - b).abs().max().item() <= LOGIT_TOLERANCE


def test_export_from_an_offloaded_zero3_checkpoint(tmp_path):
    """Optimizer and parameters offloaded to host memory (ZeRO-Infinity's tiers), DP 2: the same export."""
    argv = MODEL + ["--mock-data", "--vocab-size", "300", "--micro-batch-size", "2", "--global-batch-size", "4",
                    "--train-iters", "3", "--lr", "1e-3", "--eval-iters", "1", "--eval-interval", "1000",
                    "--log-interval", "1", "--zero-stage", "3", "--offload-optimizer", "cpu", "--offload-params",
                    "cpu", "--save", str(tmp_path / "ckpt")]
    run_ranks(2, quiet_main, argv)
    assert export_main(["--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf")]) == 0
    ids = torch.randint(0, 300, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        reference = _hf_model(str(tmp_path / "hf"))(torch.tensor([ids])).logits[0]
    ours = run_ranks(1, mpzero_logits, str(tmp_path / "ckpt"), [ids], 1)[0][0]
    assert (ours - reference).abs().max().item() <= LOGIT_TOLERANCE


def test_export_carries_architecture_and_tokenizer(trained, exported):
    bpe = json.load(open(os.path.join(exported["bpe"], "config.json")))
    assert (bpe["activation_function"], bpe["tie_word_embeddings"], bpe["vocab_size"], bpe["n_positions"],
            bpe["layer_norm_epsilon"], bpe["resid_pdrop"]) == ("gelu_new", False, 512, 128, 1e-5, 0.0)
    sp = json.load(open(os.path.join(exported["sp"], "config.json")))
    assert (sp["activation_function"], sp["tie_word_embeddings"], sp["resid_pdrop"]) == ("gelu", True, 0.1)
    tokenizer, id_lists = _token_ids(trained, "bpe")
    hf_tokenizer = AutoTokenizer.from_pretrained(exported["bpe"])
    assert [hf_tokenizer.encode(text)[:128] for text in trained.texts] == id_lists
    assert bpe["eos_token_id"] == hf_tokenizer.eos_token_id == tokenizer.eod
    sp_model = dict(zip(trained.sp.tokenizer_flags[::2], trained.sp.tokenizer_flags[1::2]))["--tokenizer-model"]
    with open(sp_model, "rb") as a, open(os.path.join(exported["sp"], "sentencepiece.model"), "rb") as b:
        assert a.read() == b.read()
    assert "sentencepiece.SentencePieceProcessor" in open(os.path.join(exported["sp"], "README.md")).read()


@pytest.mark.parametrize("name", ["bpe", "sp"])
def test_import_then_export_gives_identical_tensors(exported, tmp_path, name):
    assert import_main(["--input", exported[name], "--save", str(tmp_path / "ckpt")]) == 0
    assert export_main(["--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "again")]) == 0
    first, again = load_file(os.path.join(exported[name], "model.safetensors")), \
        load_file(str(tmp_path / "again" / "model.safetensors"))
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    for file in ("config.json", "vocab.json", "merges.txt", "sentencepiece.model"):
        if os.path.exists(os.path.join(exported[name], file)):
            assert open(os.path.join(exported[name], file), "rb").read() == (tmp_path / "again" / file).read_bytes()


def test_import_reads_the_original_gpt2_layout(exported, tmp_path):
    """openai-community/gpt2's files: keys without `transformer.`, the causal-mask buffers of older transformers,
    pytorch_model.bin; the buffers are dropped and the weights are the same."""
    state = load_file(os.path.join(exported["sp"], "model.safetensors"))
    old = {key.removeprefix("transformer."): t for key, t in state.items()}
    old.update({f"h.{i}.attn.bias": torch.ones(1, 1, 128, 128).tril() for i in range(2)})
    old.update({f"h.{i}.attn.masked_bias": torch.tensor(-1e4) for i in range(2)})
    os.makedirs(tmp_path / "old")
    for name in ("config.json", "sentencepiece.model"):
        (tmp_path / "old" / name).write_bytes(open(os.path.join(exported["sp"], name), "rb").read())
    torch.save(old, tmp_path / "old" / "pytorch_model.bin")
    assert import_main(["--input", str(tmp_path / "old"), "--save", str(tmp_path / "ckpt")]) == 0
    assert export_main(["--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "again")]) == 0
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert again.keys() == state.keys() and all(torch.equal(state[k], again[k]) for k in state)


def test_imported_model_finetunes_at_tp2_from_the_same_loss(exported, tmp_path):
    """lr 0 for one step: the iteration-1 loss is HF's on the same (mock) batch, and the saved weights are HF's."""
    assert import_main(["--input", exported["bpe"], "--save", str(tmp_path / "imported")]) == 0
    argv = MODEL + ["--load", str(tmp_path / "imported"), "--finetune", "--openai-gelu",
                    "--untie-embeddings-and-output-weights", "--mock-data", "--vocab-size", "512",
                    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1", "--lr", "0",
                    "--min-lr", "0", "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "1",
                    "--eval-interval", "1000", "--log-interval", "1", "--save", str(tmp_path / "tuned"),
                    "--tensor-model-parallel-size", "2"]
    loss = run_ranks(2, quiet_main, argv)[0]["losses"][0]
    hf = _hf_model(exported["bpe"])
    samples = torch.stack([torch.from_numpy(MockGPTDataset(512, 64, 1234, 4)[i]["tokens"]) for i in range(4)])
    with torch.no_grad():
        logits = hf(samples[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 512), samples[:, 1:].reshape(-1))
    assert abs(loss - expected.item()) <= 1e-5 * expected.item()
    assert export_main(["--load", str(tmp_path / "tuned"), "--output", str(tmp_path / "out")]) == 0
    tuned, original = load_file(str(tmp_path / "out" / "model.safetensors")), \
        load_file(os.path.join(exported["bpe"], "model.safetensors"))
    assert all(torch.equal(tuned[k], original[k]) for k in original)


def _one_error_line(main, argv, capsys, *absent):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    for path in absent:
        assert not os.path.exists(path) and not glob.glob(glob.escape(str(path)) + ".tmp*")
    return err


def _gpt2_dir(path, exported, **config):
    os.makedirs(path)
    base = json.load(open(os.path.join(exported["sp"], "config.json")))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**base, **config}, f)
    return load_file(os.path.join(exported["sp"], "model.safetensors"))


@pytest.mark.parametrize("case,message", [
    ("empty", "is not a Hugging Face model directory (no config.json)"),
    ("bert", "has model_type 'bert': only 'gpt2', 'llama', 'mixtral' and 'qwen3_moe' models import"),
    ("relu", "has activation_function 'relu'"),
    ("narrow_mlp", "has n_inner 128"),
    ("missing_tensor", "has no transformer.h.1.mlp.c_proj.bias"),
    ("no_weights", "has no weights"),
])
def test_import_refuses_what_is_not_a_gpt2_model(exported, tmp_path, capsys, case, message):
    source = str(tmp_path / "in")
    if case == "empty":
        os.makedirs(source)
    else:
        config = {"bert": {"model_type": "bert"}, "relu": {"activation_function": "relu"},
                  "narrow_mlp": {"n_inner": 128}}.get(case, {})
        state = _gpt2_dir(source, exported, **config)
        if case == "missing_tensor":
            del state["transformer.h.1.mlp.c_proj.bias"]
        if case != "no_weights":
            save_file(state, os.path.join(source, "model.safetensors"))
    err = _one_error_line(import_main, ["--input", source, "--save", str(tmp_path / "out")], capsys, tmp_path / "out")
    assert message in err


def test_import_refuses_a_used_save_directory(exported, tmp_path, capsys):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "keep.txt").write_text("x")
    err = _one_error_line(import_main, ["--input", exported["sp"], "--save", str(tmp_path / "used")], capsys)
    assert "already exists and is not empty" in err and (tmp_path / "used" / "keep.txt").exists()


def test_export_refuses_another_architecture(trained, tmp_path, capsys):
    weights = read_consolidated(trained.sp.checkpoint, None)
    plain = {"model": {"fc.weight": torch.zeros(4, 4)}, "meta": {"config": {"lr": 1e-3}}}
    save_weights_only(plain, str(tmp_path / "plain"))
    err = _one_error_line(export_main, ["--load", str(tmp_path / "plain"), "--output", str(tmp_path / "o1")], capsys,
                          tmp_path / "o1")
    assert "does not state its model's --num-layers" in err
    claims_three = {**weights["meta"]["config"], "num_layers": 3}
    save_weights_only({"model": weights["model"], "meta": {"config": claims_three}}, str(tmp_path / "three"))
    err = _one_error_line(export_main, ["--load", str(tmp_path / "three"), "--output", str(tmp_path / "o2")], capsys,
                          tmp_path / "o2")
    assert "layers.2.attention.dense.bias is absent there" in err


def test_export_refuses_an_existing_output(trained, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    err = _one_error_line(export_main, ["--load", trained.sp.checkpoint, "--output", str(tmp_path / "out")], capsys)
    assert "already exists" in err
