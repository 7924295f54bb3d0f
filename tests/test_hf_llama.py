"""tools/export_hf.py and tools/import_hf.py against transformers' LlamaForCausalLM (built here from a config:
nothing is downloaded). A LLaMA trained at TP 2 x DP 2 under ZeRO-3 (GQA, RoPE, RMSNorm, SwiGLU) exports to a
directory HF loads with no missing or unexpected key, with mpzero's logits at TP 1 and 2 (fp32: 1e-4, the issue's
bound), its head size 12 (--kv-channels; hidden 32 / 4 heads would be 8) as head_dim; a randomly initialized HF Llama
(GQA, theta 500000, untied with head_dim 12, and tied in sharded safetensors) imports with HF's logits at TP 1 and
2, greedy generation through mpzero's GQA KV cache equals HF's `generate`, and import -> export gives back
identical tensors."""

import contextlib
import io
import json
import os
import runpy

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from mpzero.inference import SamplingConfig, generate, gpt_config_from_meta, load_full_weights
from mpzero.models import GPTModel
from mpzero.parallel import init_parallel
from tests.cli import TINY, quiet_main
from tests.distributed import run_ranks
from tests.test_llama import LLAMA
from tests.trained_gpt import TOOLS, mpzero_logits
from tools.checkpoint_util import read_consolidated

export_main = runpy.run_path(os.path.join(TOOLS, "export_hf.py"))["main"]
import_main = runpy.run_path(os.path.join(TOOLS, "import_hf.py"))["main"]
LOGIT_TOLERANCE = 1e-4
IDS = [[5, 17, 250, 3, 99, 42, 7, 7, 120, 64, 1, 2, 3, 200, 150, 11]]


def _quiet(fn, argv):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return fn(argv)


def _hf_model(directory):
    with contextlib.redirect_stderr(io.StringIO()):
        model, info = LlamaForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    return model.eval()


def test_a_tp2_zero3_llama_exports_to_llama_for_causal_lm(tmp_path):
    checkpoint, output = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    run_ranks(4, quiet_main, LLAMA + ["--tensor-model-parallel-size", "2", "--zero-stage", "3", "--train-iters", "4",
                                      "--eval-iters", "0", "--rotary-base", "500000", "--kv-channels", "12",
                                      "--save", checkpoint])
    assert _quiet(export_main, ["--load", checkpoint, "--output", output]) == 0
    hf = json.load(open(os.path.join(output, "config.json")))
    assert (hf["model_type"], hf["num_key_value_heads"], hf["intermediate_size"], hf["rms_norm_eps"],
            hf["tie_word_embeddings"], hf["rope_parameters"]["rope_theta"], hf["head_dim"]) == (
        "llama", 2, 48, 1e-6, False, 500000.0, 12)
    with torch.no_grad():
        theirs = _hf_model(output)(torch.tensor(IDS)).logits[0]
    for tp in (1, 2):
        ours = run_ranks(tp, mpzero_logits, checkpoint, IDS, tp)[0][0]
        torch.testing.assert_close(ours, theirs, rtol=0, atol=LOGIT_TOLERANCE)


def _random_hf_llama(directory, tied):
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=500000.0,
                         rms_norm_eps=1e-6, tie_word_embeddings=tied, initializer_range=0.2, eos_token_id=None,
                         bos_token_id=None, head_dim=8 if tied else 12)  # untied: 4 x 12 != 32, --kv-channels
    torch.manual_seed(7)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, max_shard_size="100KB" if tied else "1GB")  # tied: sharded safetensors
    return model


def _safetensors(directory):
    """Every tensor of a directory's safetensors files (one file or shards)."""
    names = [n for n in os.listdir(directory) if n.endswith(".safetensors")]
    return {k: t for n in names for k, t in load_file(os.path.join(directory, n)).items()}


def _mpzero_greedy(checkpoint, prompts, tp, new_tokens):
    bundle = read_consolidated(checkpoint, None)
    groups = init_parallel(tp)
    model = GPTModel(gpt_config_from_meta(bundle["meta"], checkpoint), groups.tp).eval()
    load_full_weights(model, bundle["model"])
    sampling = SamplingConfig(max_new_tokens=new_tokens, greedy=True, stop_at_eod=False)
    return generate(model, prompts, sampling, eod=0), generate(model, prompts, sampling, eod=0, use_cache=False)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_random_hf_llama_imports_with_its_logits_and_greedy_generation(tmp_path, tied):
    source, checkpoint, again = str(tmp_path / "hf"), str(tmp_path / "ckpt"), str(tmp_path / "again")
    hf_model = _random_hf_llama(source, tied)
    assert _quiet(import_main, ["--input", source, "--save", checkpoint]) == 0
    with torch.no_grad():
        theirs = hf_model(torch.tensor(IDS)).logits[0]
    for tp in (1, 2):
        ours = run_ranks(tp, mpzero_logits, checkpoint, IDS, tp)[0][0]
        torch.testing.assert_close(ours, theirs, rtol=0, atol=LOGIT_TOLERANCE)
    prompts = [IDS[0][:5], IDS[0][3:12]]
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    for tp in (1, 2):
        cached, full = run_ranks(tp, _mpzero_greedy, checkpoint, prompts, tp, 12)[0]
        assert cached == full == expected
    assert _quiet(export_main, ["--load", checkpoint, "--output", again]) == 0  # import -> export: the same tensors
    if tied:
        assert os.path.isfile(os.path.join(source, "model.safetensors.index.json"))
    original, exported = _safetensors(source), _safetensors(again)
    assert original.keys() == exported.keys() and all(torch.equal(original[k], exported[k]) for k in original)


def test_a_gpt2_style_model_with_llama_parts_is_refused_by_export(tmp_path, capsys):
    checkpoint = str(tmp_path / "ckpt")
    run_ranks(1, quiet_main, TINY + ["--normalization", "RMSNorm", "--train-iters", "1", "--eval-iters", "0",
                                     "--save", checkpoint])
    assert export_main(["--load", checkpoint, "--output", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "LlamaForCausalLM cannot compute it" in err and not (tmp_path / "hf").exists()
