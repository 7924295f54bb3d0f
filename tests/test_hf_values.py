"""What a Hugging Face config.json and its files may say, and what the import makes of it (issue 42, items 3-4;
mpzero/inference/hf_values.py, hf.py, hf_llama.py):
  - every numeric key of each adapter's HF_DEFAULTS names the pretrain_gpt.py flag it becomes (HF_FLAGS: a key
    added to HF_DEFAULTS without one fails here), and every value just outside that flag's range
    (mpzero/cli/flag_ranges.py) is one line naming the key: `layer_norm_epsilon: -1.0` as --layernorm-epsilon;
  - tie_word_embeddings true with a stored lm_head.weight of other values imports as the installed transformers
    loads it (the stored head kept: checked against transformers here), with a note; an equal one stays tied;
  - Llama 3's rope_scaling beside a default rope_parameters is refused, never imported unscaled."""

import contextlib
import io
import json
import os
import runpy

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from mpzero.cli.flag_ranges import RANGES
from mpzero.errors import ConfigError
from mpzero.inference import hf_gpt2, hf_llama, hf_mixtral, hf_qwen3_moe
from mpzero.inference.hf import ADAPTERS
from tests.cli import tool_result
from tests.trained_gpt import TOOLS
from tools.checkpoint_util import read_consolidated

import_main = runpy.run_path(os.path.join(TOOLS, "import_hf.py"))["main"]
FAMILIES = {"gpt2": (hf_gpt2, hf_gpt2.gpt_config_from_hf, {"model_type": "gpt2", "n_embd": 32, "n_layer": 1,
                                                           "n_head": 4, "n_positions": 64, "vocab_size": 300}),
            "llama": (hf_llama, hf_llama.config_from_hf, {"model_type": "llama", "hidden_size": 32,
                                                          "intermediate_size": 48, "num_hidden_layers": 1,
                                                          "num_attention_heads": 4, "vocab_size": 300}),
            "mixtral": (hf_mixtral, hf_mixtral.config_from_hf, {"model_type": "mixtral", "hidden_size": 32,
                                                                "intermediate_size": 48, "num_hidden_layers": 1,
                                                                "num_attention_heads": 4, "num_key_value_heads": 2,
                                                                "vocab_size": 300, "num_local_experts": 4,
                                                                "num_experts_per_tok": 2}),
            "qwen3_moe": (hf_qwen3_moe, hf_qwen3_moe.config_from_hf, {
                "model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "num_experts": 4,
                "moe_intermediate_size": 24, "num_experts_per_tok": 2})}
assert {name: module.HF_FLAGS for name, (module, _, _) in FAMILIES.items()} == {
    name: adapter.hf_flags for name, adapter in ADAPTERS.items()}, "every adapter is tested here"


def _outside(bounds, kind):
    """Values just outside a flag's range (low, low allowed?, high, high allowed?) of type `kind`."""
    low, low_ok, high, high_ok = bounds
    step = 1 if kind is int else 1e-9
    out = [] if low is None else [kind(low - step) if low_ok else kind(low), -1 if kind is int else -1.0]
    out += [] if high is None else [kind(high + step) if high_ok else kind(high)]
    return [v for v in out if not ((low is None or v > low or (v == low and low_ok))
                                   and (high is None or v < high or (v == high and high_ok)))]


def test_every_numeric_key_names_its_flag():
    for name, (module, _, _) in FAMILIES.items():
        numeric = {k for k, v in module.HF_DEFAULTS.items()  # None: an optional integer (n_inner, head_dim, ...)
                   if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))}
        missing = numeric - set(module.HF_FLAGS)
        assert not missing, f"{name}: give these config.json keys their flag in HF_FLAGS: {missing}"
        assert set(module.HF_FLAGS.values()) <= set(RANGES), name


def test_every_value_outside_its_flags_range_is_one_line_naming_the_key(tmp_path):
    cases = 0
    for name, (module, _, base) in FAMILIES.items():
        for key, dest in module.HF_FLAGS.items():
            kind = type(module.HF_DEFAULTS.get(key)) if module.HF_DEFAULTS.get(key) is not None else int
            for value in _outside(RANGES[dest], float if key == "rope_theta" else kind):
                source = tmp_path / f"{name}-{cases}"
                source.mkdir()
                (source / "config.json").write_text(json.dumps({**base, key: value}))
                code, stderr = tool_result(import_main, ["--input", str(source), "--save", str(tmp_path / "out")])
                assert code == 2 and stderr.count("\n") == 1, (name, key, value, stderr)
                assert stderr.startswith(f"error: --input {source}: {key} {value} is out of range"), stderr
                cases += 1
    print(f"HF config values out of range: {cases} cases")
    assert not (tmp_path / "out").exists()
    source = tmp_path / "eps"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({**FAMILIES["gpt2"][2], "layer_norm_epsilon": -1.0}))
    assert tool_result(import_main, ["--input", str(source), "--save", str(tmp_path / "out")]) == (
        2, f"error: --input {source}: layer_norm_epsilon -1.0 is out of range: it must be > 0.0 (it becomes "
           f"--layernorm-epsilon)\n")


def _saved_with_another_head(directory, family, equal=False):
    """A tiny model with tie_word_embeddings true, saved, then given a stored lm_head.weight (other values, or the
    embedding's own); returns the stored state."""
    torch.manual_seed(3)
    if family == "gpt2":
        model, embedding = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=32, n_layer=1, n_head=4, n_positions=64,
                                                      tie_word_embeddings=True)), "transformer.wte.weight"
    else:
        model, embedding = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48,
                                                        num_hidden_layers=1, num_attention_heads=4,
                                                        tie_word_embeddings=True)), "model.embed_tokens.weight"
    with contextlib.redirect_stderr(io.StringIO()):
        model.save_pretrained(directory)
    state = load_file(os.path.join(directory, "model.safetensors"))
    state["lm_head.weight"] = state[embedding].clone() if equal else torch.randn_like(state[embedding])
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return state, embedding


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_stored_head_under_tied_embeddings_imports_as_transformers_loads_it(tmp_path, family):
    cls = GPT2LMHeadModel if family == "gpt2" else LlamaForCausalLM
    for equal in (False, True):
        source, save = tmp_path / f"hf{equal}", tmp_path / f"ckpt{equal}"
        state, embedding = _saved_with_another_head(source, family, equal)
        with contextlib.redirect_stderr(io.StringIO()):
            loaded = cls.from_pretrained(source)
        assert torch.equal(loaded.lm_head.weight, state["lm_head.weight"])  # what transformers computes with
        code, stderr = tool_result(import_main, ["--input", str(source), "--save", str(save)])
        assert code == 0, stderr
        bundle = read_consolidated(str(save), None)
        untied = bundle["meta"]["config"]["untie_embeddings_and_output_weights"]
        assert untied == (not equal), family
        if not equal:
            assert torch.equal(bundle["model"]["output_layer.weight"], state["lm_head.weight"])
        assert torch.equal(bundle["model"]["embedding.word_embeddings.weight"], state[embedding])


def test_rope_scaling_beside_default_rope_parameters_is_refused(tmp_path):
    base = FAMILIES["llama"][2]
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    for extra in ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "rope_scaling": llama3},
                  {"rope_scaling": llama3}, {"rope_parameters": {**llama3, "rope_theta": 500000.0}},
                  {"rope_scaling": {"type": "linear", "factor": 2.0}}):
        with pytest.raises(ConfigError, match="has RoPE scaling '(llama3|linear)': mpzero's RoPE is unscaled"):
            hf_llama.config_from_hf({**base, **extra}, "config.json")
    source = tmp_path / "hf"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({**base, "rope_parameters": {"rope_type": "default",
                                                                                "rope_theta": 500000.0},
                                                    "rope_scaling": llama3}))
    code, stderr = tool_result(import_main, ["--input", str(source), "--save", str(tmp_path / "ckpt")])
    assert code == 2 and stderr.count("\n") == 1 and "RoPE scaling 'llama3'" in stderr, stderr
    assert not (tmp_path / "ckpt").exists()
