"""Context parallelism through the CLI trains like one process: the same losses, printed gradient norms and
validation losses for 10 iterations (fp32, no dropout, within 1e-5 relative: the ranks add the same terms in
another order), for every comm type at CP 2 and 4, GPT-2 (learned positions) and LLaMA (RoPE, GQA), composed with
TP + SP, DP under ZeRO 1 and 3, recomputation and the offload tiers, on data whose documents end inside the
chunks; its activation and CP traffic lines equal their formulas; checkpoints move between CP sizes.
make test runs a covering subset; the whole product is `-m product`."""

import json
import os
import re
import runpy

import numpy as np
import pytest

from tests.cli import ROOT, TINY, assert_close_lists, main_capturing_stdout, quiet_main
from tests.distributed import run_ranks

LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "48", "--position-embedding-type", "rope",
         "--no-position-embedding", "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]
MODELS = {"gpt2": [], "llama": LLAMA}
_REFERENCES: dict = {}


def _reference(model: str, extra: tuple = ()) -> dict:
    """One process's run of `model` (ZeRO 0), once per session."""
    key = (model, extra)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_ranks(1, quiet_main, TINY + MODELS[model] + ["--zero-stage", "0"] + list(extra))[0]
    return _REFERENCES[key]


def _cp(comm: str, cp: int, tp: int = 1, dp: int = 1, stage: int = 1, model: str = "gpt2", extra=()) -> tuple:
    argv = TINY + MODELS[model] + ["--context-parallel-size", str(cp), "--cp-comm-type", comm, "--zero-stage",
                                   str(stage), "--tensor-model-parallel-size", str(tp), *extra]
    return run_ranks(tp * cp * dp, main_capturing_stdout, argv, deadline=300)[0]


def _assert_like_one_process(history: dict, reference: dict) -> None:
    for key in ("losses", "grad_norms", "valid_losses"):
        assert_close_lists(history[key], reference[key])


def _assert_counted_equals_formula(stdout: str) -> None:
    """Every activation line's ratios (layers, micro-batch, the K/V held while attending) and the cp comm line's."""
    lines = [line for line in stdout.splitlines() if line.startswith(("activation memory", "cp comm"))]
    assert any(line.startswith("cp comm") for line in lines) and any("activation" in line for line in lines)
    for line in lines:
        ratios = re.findall(r"ratio (\S+)", line)
        assert ratios and all(r == "1.0000" for r in ratios), line


FAST = [("p2p", 2, "gpt2"), ("all_gather", 4, "gpt2"), ("a2a", 2, "gpt2"), ("p2p", 4, "llama"),
        ("a2a", 2, "llama")]
PRODUCT = [(comm, cp, model) for comm in ("p2p", "all_gather", "a2a") for cp in (2, 4) for model in MODELS
           if (comm, cp, model) not in FAST and not (comm == "a2a" and cp == 4 and model == "llama")]  # 2 groups


@pytest.mark.parametrize("comm,cp,model", FAST + [pytest.param(*case, marks=pytest.mark.product) for case in PRODUCT])
def test_context_parallel_matches_one_process(comm, cp, model):
    history, stdout = _cp(comm, cp, model=model)
    _assert_like_one_process(history, _reference(model))
    _assert_counted_equals_formula(stdout)


COMPOSED = [  # (comm, tp, dp, stage, extra flags): TP + SP, DP x ZeRO, the explicit blocks, recomputation, offload
    ("p2p", 2, 1, 1, ("--sequence-parallel",)), ("all_gather", 1, 2, 3, ("--attention-backend", "local")),
    ("a2a", 1, 1, 1, ("--recompute-granularity", "full", "--recompute-method", "block",
                      "--recompute-num-layers", "1"))]
COMPOSED_PRODUCT = [
    ("all_gather", 2, 1, 1, ("--sequence-parallel",)), ("a2a", 2, 1, 1, ("--sequence-parallel",)),
    ("p2p", 1, 2, 1, ()), ("all_gather", 1, 2, 1, ()), ("a2a", 1, 2, 1, ()), ("p2p", 1, 2, 3, ()),
    ("a2a", 1, 2, 3, ()), ("p2p", 1, 1, 1, ("--recompute-activations",)),
    ("all_gather", 1, 1, 1, ("--recompute-granularity", "full")),
    ("p2p", 2, 1, 1, ("--recompute-granularity", "full", "--distribute-saved-activations")),
    ("p2p", 1, 2, 3, ("--offload-optimizer", "cpu", "--offload-params", "cpu")),
    ("all_gather", 1, 1, 2, ("--offload-optimizer", "cpu", "--offload-activations", "cpu"))]


@pytest.mark.parametrize("comm,tp,dp,stage,extra",
                         COMPOSED + [pytest.param(*case, marks=pytest.mark.product) for case in COMPOSED_PRODUCT])
def test_context_parallel_composes_with_tp_dp_zero_recomputation_and_offload(comm, tp, dp, stage, extra):
    history, stdout = _cp(comm, 2, tp=tp, dp=dp, stage=stage, extra=extra)
    _assert_like_one_process(history, _reference("gpt2"))
    _assert_counted_equals_formula(stdout)


def _documents(tmp_path) -> list[str]:
    """A NullTokenizer dataset of 3-12 token documents, each ending in EOD (299): 16-token sequences at CP 2 are
    4-token chunks, and documents end inside them and across them."""
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 299, size=rng.integers(3, 13)).tolist() for _ in range(400)]
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": " ".join(map(str, d))}) + "\n" for d in docs))
    preprocess = runpy.run_path(os.path.join(ROOT, "tools", "preprocess_data.py"))["main"]
    assert preprocess(["--input", str(source), "--output-prefix", str(tmp_path / "d"), "--tokenizer-type",
                       "NullTokenizer", "--vocab-size", "299", "--append-eod", "--workers", "1",
                       "--no-progress"]) == 0
    data = [flag for flag in TINY if flag not in ("--mock-data", "--vocab-size", "300")]
    return data + ["--data-path", str(tmp_path / "d_text_document"), "--tokenizer-type", "NullTokenizer",
                   "--vocab-size", "299", "--split", "90,10,0", "--data-cache-path", str(tmp_path / "cache")]


def test_documents_ending_inside_chunks_train_like_one_process(tmp_path):
    argv = _documents(tmp_path) + LLAMA
    reference = run_ranks(1, quiet_main, argv + ["--zero-stage", "0"])[0]
    history = run_ranks(2, quiet_main, argv + ["--context-parallel-size", "2"], deadline=300)[0]
    _assert_like_one_process(history, reference)


@pytest.mark.parametrize("saved,loaded", [(("p2p", 2, 1), ("all_gather", 4, 1)),
                                          pytest.param(("a2a", 2, 2), ("p2p", 1, 1), marks=pytest.mark.product)])
def test_a_checkpoint_moves_between_cp_sizes_at_the_uninterrupted_losses(tmp_path, saved, loaded):
    """Saved at iteration 5 with one CP layout (comm, CP, DP), resumed with another: iterations 6-10 are those of
    one process that never stopped."""
    argv = TINY + ["--eval-iters", "0", "--zero-stage", "3"]
    uninterrupted = _reference("gpt2", ("--eval-iters", "0"))

    def layout(comm, cp, dp):
        return cp * dp, ["--context-parallel-size", str(cp), "--cp-comm-type", comm]
    world, flags = layout(*saved)
    run_ranks(world, quiet_main, argv + flags + ["--save", str(tmp_path), "--exit-interval", "5"], deadline=300)
    world, flags = layout(*loaded)
    resumed = run_ranks(world, quiet_main, argv + flags + ["--load", str(tmp_path)], deadline=300)[0]
    assert_close_lists(resumed["losses"], uninterrupted["losses"][5:])
    assert_close_lists(resumed["grad_norms"], uninterrupted["grad_norms"][5:])
