"""tools/export_hf.py and tools/import_hf.py for mixtures of experts (mpzero/inference/hf_moe.py, hf_mixtral.py,
hf_qwen3_moe.py) against the real transformers classes, built here from configs (nothing downloaded):
  - a LLaMA with MoE layers trained at EP 2 exports, sharded, with the hub's per-expert names, to a directory
    MixtralForCausalLM loads with no missing or unexpected key; logits within 1e-4 (fp32, the issue's bound) and
    the same experts chosen at TP 1 x EP 1, EP 2 and TP 2 x EP 2 (expert-TP 1); tools/generate.py at EP 2 and TP 2 x
    EP 2 gives HF's greedy tokens; with --qk-layernorm, a dense layer and --moe-router-pre-softmax: Qwen3-MoE;
  - --kv-channels 12 at hidden 32 (the published Qwen3-MoE's head_dim 128 != hidden/heads) exports and imports;
  - a randomly initialized local Mixtral and Qwen3-MoE (q/k norms, a dense first layer, top-k not renormalised)
    import with HF's logits and routing at those layouts and at TP 2 x EP 2 with each expert split over TP,
    greedy generation equal (TP 2 x EP 2), export back to HF's own tensors, and train on with the flags the import
    prints at EP 1 and EP 2 with the same losses; transformers 5's fused expert names import too; the rest: one line."""

import contextlib
import io
import json
import os
import runpy
import shlex
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from mpzero.inference import SamplingConfig, generate, gpt_config_from_meta, load_full_weights
from mpzero.models import GPTModel
from mpzero.moe import MoELayer, restore_expert_biases, top_k
from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import gather_from_tp
from tests.cli import assert_close_lists, main_capturing_stdout, quiet_main, tool_result
from tests.distributed import run_ranks
from tests.test_llama import LLAMA
from tests.trained_gpt import TOOLS
from tools.checkpoint_util import read_consolidated

export_main = runpy.run_path(os.path.join(TOOLS, "export_hf.py"))["main"]
import_main = runpy.run_path(os.path.join(TOOLS, "import_hf.py"))["main"]
generate_main = runpy.run_path(os.path.join(TOOLS, "generate.py"))["main"]
LOGIT_TOLERANCE = 1e-4
IDS = [5, 17, 250, 3, 99, 42, 7, 7, 120, 64, 1, 2, 3, 200, 150, 11]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24"]
LAYOUTS = [(1, 1, None), (1, 2, None), (2, 2, 1)]  # (TP, EP, expert-TP): worlds of 1, 2 and 2 ranks
EXPERT_TP = (2, 2, None)  # each expert split over TP (the default expert-TP): a world of 4
WORLD = {(1, 1, None): 1, (1, 2, None): 2, (2, 2, 1): 2, EXPERT_TP: 4}
FINETUNE = ["--seq-length", "16", "--mock-data", "--vocab-size", "300", "--micro-batch-size", "2", "--lr", "1e-3",
            "--global-batch-size", "8", "--train-iters", "2", "--eval-iters", "0", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--log-interval", "1"]


def _generate(argv):
    """tools/generate.py's main, by a name a rank started from a fork server can find (tests/distributed.py)."""
    return generate_main(argv)


def _quiet(fn, argv, stdout=None):
    with contextlib.redirect_stdout(stdout or io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return fn(argv)


def _files(directory):
    """Every tensor of a directory's safetensors files (one file or shards)."""
    names = [n for n in os.listdir(directory) if n.endswith(".safetensors")]
    return {k: t for n in names for k, t in load_file(os.path.join(directory, n)).items()}


def _hf(directory):
    with contextlib.redirect_stderr(io.StringIO()):
        model, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    return model.eval()


def _hf_run(model, ids):
    """(logits [s, V], each MoE layer's chosen experts [s, k] sorted) of HF's model."""
    chosen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out: chosen.append(out[2].sort(dim=1).values))
             for layer in model.model.layers if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    for hook in hooks:
        hook.remove()
    return logits, chosen


def _mpzero_model(checkpoint, tp, ep, etp):
    bundle = read_consolidated(checkpoint, None)
    groups = init_parallel(tp, ep_size=ep, etp_size=etp)
    model = GPTModel(gpt_config_from_meta(bundle["meta"], checkpoint), groups.tp, ep=groups.ep,
                     expert_tp=groups.expert_tp).eval()
    load_full_weights(model, bundle["model"])
    return model, groups


def _mpzero_run(checkpoint, ids, tp, ep, etp):
    """(logits [s, V], each MoE layer's chosen experts [s, k] sorted) at TP x EP (x expert-TP)."""
    model, groups = _mpzero_model(checkpoint, tp, ep, etp)
    config, logits_of = model.config, []
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    hooks = [layer.router.register_forward_hook(lambda m, i, out: logits_of.append(out)) for layer in layers]
    with torch.no_grad():
        logits = gather_from_tp(model(torch.tensor([ids])), groups.tp)[0, :, :config.vocab_size]
    for hook in hooks:
        hook.remove()
    chosen = [top_k(out, config.moe_router_topk, "softmax", config.moe_router_pre_softmax)[1].sort(dim=1).values
              for out in logits_of]
    return logits, chosen


def _check_against_hf(checkpoint, theirs, layouts=tuple(LAYOUTS)):
    for tp, ep, etp in layouts:
        logits, chosen = run_ranks(WORLD[tp, ep, etp], _mpzero_run, checkpoint, IDS, tp, ep, etp)[0]
        torch.testing.assert_close(logits, theirs[0], rtol=0, atol=LOGIT_TOLERANCE)
        assert len(chosen) == len(theirs[1]) and all(torch.equal(a, b) for a, b in zip(chosen, theirs[1]))


def _hf_greedy(model, prompts, new_tokens):
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LLaMA whose layers are all MoE (4 experts, top-2), trained 3 steps at EP 2 x DP 2 with the alltoall
    dispatcher, and its Mixtral export in shards of at most 40KB."""
    base = tmp_path_factory.mktemp("moe")
    checkpoint, output = str(base / "ckpt"), str(base / "hf")
    run_ranks(2, quiet_main, LLAMA + MOE + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                                            "alltoall", "--train-iters", "3", "--eval-iters", "0", "--lr", "1e-2",
                                            "--save", checkpoint])
    assert _quiet(export_main, ["--load", checkpoint, "--output", output, "--max-shard-size", "40KB"]) == 0
    return checkpoint, output


def test_an_ep2_checkpoint_exports_to_mixtral_with_its_logits_and_routing(trained):
    checkpoint, output = trained
    hf = json.load(open(os.path.join(output, "config.json")))
    assert (hf["model_type"], hf["num_local_experts"], hf["num_experts_per_tok"], hf["intermediate_size"],
            hf["num_key_value_heads"]) == ("mixtral", 4, 2, 24, 2)
    index = json.load(open(os.path.join(output, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1 and set(index["weight_map"]) == set(_files(output))
    names = set(index["weight_map"])
    assert {f"model.layers.1.block_sparse_moe.experts.3.{w}.weight" for w in ("w1", "w2", "w3")} <= names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names and not any(".mlp." in n for n in names)
    _check_against_hf(checkpoint, _hf_run(_hf(output), IDS))


def test_an_ep2_checkpoint_with_qk_norms_and_a_dense_layer_exports_to_qwen3_moe(tmp_path):
    checkpoint, output = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    run_ranks(2, quiet_main, LLAMA + MOE + ["--qk-layernorm", "--moe-layer-freq", "[0,1]", "--moe-router-pre-softmax",
                                            "--kv-channels", "12", "--expert-model-parallel-size", "2",
                                            "--train-iters", "3",
                                            "--eval-iters", "0", "--lr", "1e-2", "--save", checkpoint])
    assert _quiet(export_main, ["--load", checkpoint, "--output", output]) == 0
    hf = json.load(open(os.path.join(output, "config.json")))
    assert (hf["model_type"], hf["num_experts"], hf["moe_intermediate_size"], hf["intermediate_size"],
            hf["mlp_only_layers"], hf["norm_topk_prob"], hf["head_dim"]) == ("qwen3_moe", 4, 24, 48, [0], False, 12)
    names = set(_files(output))
    assert {"model.layers.1.mlp.experts.3.down_proj.weight", "model.layers.0.mlp.gate_proj.weight",
            "model.layers.0.self_attn.q_norm.weight"} <= names
    _check_against_hf(checkpoint, _hf_run(_hf(output), IDS))


def test_generate_at_tp_x_ep_gives_hf_greedy_tokens(trained):
    checkpoint, output = trained
    prompts = [IDS[:5], IDS[3:12]]
    expected = _hf_greedy(_hf(output), prompts, 6)  # within the 16 positions
    argv = ["--load", checkpoint, "--greedy", "--max-new-tokens", "6", "--ignore-eod", "--output-format", "jsonl"]
    argv += [arg for p in prompts for arg in ("--prompt", " ".join(map(str, p)))]
    for extra in (["--expert-model-parallel-size", "2"],
                  ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                   "--expert-tensor-parallel-size", "1"]):
        ranks = run_ranks(2, _quiet, _generate, argv + extra)
        assert [r["tokens"] for r in ranks[0]] == [r["tokens"] for r in ranks[1]] == expected, extra
    for world, extra, message in ((1, ["--expert-model-parallel-size", "2"], "x 2 data-parallel ranks of the expert"),
                                  (3, ["--expert-model-parallel-size", "3"], "--num-experts 4 is not a multiple of")):
        code, err = run_ranks(world, tool_result, _generate, argv + extra)[0]
        assert code == 2 and err.count("\n") == 1 and message in err, err


def _mpzero_greedy(checkpoint, prompts, new_tokens, tp=1, ep=1, etp=None):
    """Greedy tokens of the checkpoint at TP x EP (x expert-TP), its routers' expert biases restored, and those."""
    model, _ = _mpzero_model(checkpoint, tp, ep, etp)
    biases = read_consolidated(checkpoint, None)["meta"].get("moe_expert_bias", {})
    restore_expert_biases(model, biases, checkpoint)
    sampling = SamplingConfig(max_new_tokens=new_tokens, greedy=True, stop_at_eod=False)
    return generate(model, prompts, sampling, eod=0), biases


def test_generate_routes_with_the_trained_expert_bias_at_any_ep(tmp_path):
    """Aux-loss-free balancing (sigmoid scores, --moe-router-enable-expert-bias): the bias steers the choice, so
    tools/generate.py restores it from the checkpoint at every layout."""
    checkpoint = str(tmp_path / "ckpt")
    run_ranks(2, quiet_main, LLAMA + MOE + ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                                            "--moe-router-bias-update-rate", "0.05", "--expert-model-parallel-size",
                                            "2", "--train-iters", "3", "--eval-iters", "0", "--save", checkpoint])
    prompts = [IDS[:5], IDS[3:12]]
    expected, biases = run_ranks(1, _mpzero_greedy, checkpoint, prompts, 6)[0]
    assert biases and all(any(b != 0 for b in bias) for bias in biases.values()), biases
    argv = ["--load", checkpoint, "--greedy", "--max-new-tokens", "6", "--ignore-eod", "--tensor-model-parallel-size",
            "2", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
    argv += [arg for p in prompts for arg in ("--prompt", " ".join(map(str, p)))]
    ranks = run_ranks(2, _quiet, _generate, argv)
    assert [r["tokens"] for r in ranks[0]] == expected


def _random_hf(kind, directory):
    """A randomly initialized local HF MoE, saved in shards; (model, its config's model_type)."""
    common = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, rms_norm_eps=1e-6, initializer_range=0.2, num_experts_per_tok=2,
                  bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
    if kind == "mixtral":
        config = MixtralConfig(**common, intermediate_size=24, num_local_experts=4,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    else:  # a dense first layer (mlp_only_layers), top-k gates not renormalised (norm_topk_prob false), and a head
        # size other than hidden / heads as every published Qwen3-MoE has (head_dim 128, hidden 2048, 32 heads)
        config = Qwen3MoeConfig(**common, intermediate_size=40, moe_intermediate_size=24, num_experts=4,
                                mlp_only_layers=[0], norm_topk_prob=False, head_dim=12)  # 4 x 12 != 32: --kv-channels
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(directory, max_shard_size="60KB")
    return model


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_a_random_hf_moe_imports_with_its_logits_routing_and_greedy_tokens(tmp_path, kind):
    source, checkpoint, again = str(tmp_path / "hf"), str(tmp_path / "ckpt"), str(tmp_path / "again")
    model = _random_hf(kind, source)
    assert os.path.isfile(os.path.join(source, "model.safetensors.index.json"))
    printed = io.StringIO()
    assert _quiet(import_main, ["--input", source, "--save", checkpoint], printed) == 0
    _check_against_hf(checkpoint, _hf_run(model, IDS), (*LAYOUTS, EXPERT_TP))
    flags = shlex.split(printed.getvalue().split("--finetune ", 1)[1].split("--seq-length N")[0])  # as printed
    run = flags + FINETUNE + ["--load", checkpoint, "--finetune"]  # trains on from it at EP 1 and EP 2 alike
    ep1, ep2 = (run_ranks(n, main_capturing_stdout, run + ["--expert-model-parallel-size", str(n)])[0][0]["losses"]
                for n in (1, 2))
    assert len(ep1) == 2 and assert_close_lists(ep2, ep1) is None
    prompts = [IDS[:5], IDS[3:12]]
    assert run_ranks(2, _mpzero_greedy, checkpoint, prompts, 8, 2, 2, 1)[0][0] == _hf_greedy(model, prompts, 8)
    assert _quiet(export_main, ["--load", checkpoint, "--output", again]) == 0  # import -> export: HF's tensors
    original, exported = _files(source), _files(again)
    assert original.keys() == exported.keys() and all(torch.equal(original[k], exported[k]) for k in original)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "qwen3_moe", "head_dim": 0}, "head_dim 0 is out of range: it must be >= 1 (it becomes "
                                                 "--kv-channels)"),
    ({"model_type": "qwen3_moe", "use_sliding_window": True}, "has use_sliding_window true"),
    ({"model_type": "mixtral", "sliding_window": 16}, "has sliding_window 16"),
    ({"model_type": "mixtral", "num_experts_per_tok": 5}, "--moe-router-topk 5 must lie between 1 and"),
    ({"model_type": "mixtral", "num_experts_per_tok": 1}, "one expert with its gate renormalised to 1"),
    ({"model_type": "qwen3_moe", "mlp_only_layers": "0"}, "mlp_only_layers is '0', not a list"),
])
def test_an_hf_moe_mpzero_cannot_compute_is_one_line(tmp_path, change, message):
    (tmp_path / "hf").mkdir()
    config = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 300, "intermediate_size": 24, "num_local_experts": 4, "num_experts": 4,
              "moe_intermediate_size": 24, "max_position_embeddings": 64, **change}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    code, err = tool_result(import_main, ["--input", str(tmp_path / "hf"), "--save", str(tmp_path / "out")])
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case, message", [
    ("missing", "has no model.layers.1.block_sparse_moe.experts.2.w3.weight: not a complete MixtralForCausalLM"),
    ("extra", "holds model.layers.1.block_sparse_moe.experts.4.w1.weight, which a MixtralForCausalLM of its"),
    ("misshapen", "experts.0.w3.weight, model.layers.0.block_sparse_moe.experts.1.w1.weight and 5 more do not have "
                  "the shapes a MixtralForCausalLM of its config.json has (together [4, 48, 32])"),
    ("fused", None),  # transformers 5's in-memory names (a state_dict() saved as is) import too
])
def test_expert_tensors_fused_missing_extra_or_misshapen(tmp_path, case, message):
    source = str(tmp_path / "hf")
    model = _random_hf("mixtral", source)
    state = {k: t.detach().contiguous() for k, t in model.state_dict().items()} if case == "fused" else _files(source)
    shutil.copytree(source, tmp_path / "in", ignore=shutil.ignore_patterns("*.safetensors*"))  # config.json
    expert = "model.layers.{}.block_sparse_moe.experts.{}.{}.weight"
    if case == "missing":
        del state[expert.format(1, 2, "w3")]
    elif case == "extra":
        state[expert.format(1, 4, "w1")] = state[expert.format(1, 0, "w1")].clone()
    elif case == "misshapen":
        state[expert.format(0, 0, "w1")] = state[expert.format(0, 0, "w1")][:-1]
    save_file(state, str(tmp_path / "in" / "model.safetensors"))
    code, err = tool_result(import_main, ["--input", str(tmp_path / "in"), "--save", str(tmp_path / "out")])
    if message is None:
        weights = read_consolidated(str(tmp_path / "out"), None)["model"]
        experts = model.model.layers[1].mlp.experts
        assert code == 0 and torch.equal(weights["layers.1.mlp.experts.weight1"], experts.gate_up_proj.detach())
    else:
        assert code == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("flags, message", [
    (["--moe-router-score-function", "sigmoid"], "--moe-router-score-function sigmoid (HF: softmax)"),
    (["--moe-layer-freq", "2"], "dense layers (--moe-layer-freq; Mixtral: every layer MoE)"),
    (["--moe-router-topk-scaling-factor", "2.5"], "--moe-router-topk-scaling-factor 2.5 (HF: gates unscaled)"),
])
def test_an_moe_hf_cannot_compute_is_refused_by_export(tmp_path, flags, message):
    checkpoint = str(tmp_path / "ckpt")
    run_ranks(1, quiet_main, LLAMA + MOE + flags + ["--train-iters", "1", "--eval-iters", "0", "--save", checkpoint])
    code, err = tool_result(export_main, ["--load", checkpoint, "--output", str(tmp_path / "hf")])
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "hf").exists()
