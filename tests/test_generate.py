"""tools/generate.py and mpzero.inference.generation against transformers' generate and the model's own forward.

The token-for-token checks use a GPT-2 with large random weights (std 0.3: its greedy choices depend on the
context and win by about 4e-3 or more, far above the ~1e-6 by which two fp32 summation orders differ), saved by
transformers, imported, and exported again for HF's side. Each CLI run is a forked gloo world (run_ranks), so
TP 2 is the same command as TP 1.
"""

import contextlib
import io
import json
import os
import runpy
import shutil
import sys

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from mpzero.data import build_tokenizer
from mpzero.inference import (KVCache, SamplingConfig, filter_logits, forward_cached, forward_full, generate,
                              gpt_config_from_meta, load_full_weights)
from mpzero.models import GPTModel
from mpzero.parallel import init_parallel
from tests.cli import TINY, quiet_main
from tests.distributed import run_ranks
from tests.trained_gpt import TOOLS, corpus_texts, gpt2_bpe_files, runs
from tools.checkpoint_util import read_consolidated

generate_main = runpy.run_path(os.path.join(TOOLS, "generate.py"))["main"]
import_main = runpy.run_path(os.path.join(TOOLS, "import_hf.py"))["main"]
export_main = runpy.run_path(os.path.join(TOOLS, "export_hf.py"))["main"]
SAMPLING = ["--temperature", "0.9", "--top-k", "50", "--top-p", "0.95"]


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """(mpzero checkpoint, HF model exported from it, tokenizer, prompts of 4 to ~20 tokens)."""
    base = tmp_path_factory.mktemp("generate")
    flags = gpt2_bpe_files(base, corpus_texts(2000))
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=flags[3], merge_file=flags[5])
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, n_positions=128, n_embd=64, n_layer=2, n_head=4, initializer_range=0.3,
                        bos_token_id=tokenizer.eod, eos_token_id=tokenizer.eod)
    GPT2LMHeadModel(config).save_pretrained(base / "hf")
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(base / "bpe" / name, base / "hf" / name)
    assert import_main(["--input", str(base / "hf"), "--save", str(base / "ckpt")]) == 0
    assert export_main(["--load", str(base / "ckpt"), "--output", str(base / "exported")]) == 0
    hf = GPT2LMHeadModel.from_pretrained(base / "exported").eval()
    prompts = [" ".join(text.split())[:length] for text, length in zip(corpus_texts(3, skip=6000), (12, 40, 70))]
    return str(base / "ckpt"), hf, tokenizer, prompts


def _cli(argv, stdin=None):
    """(exit code, results, stdout, stderr) of tools/generate.py in this rank."""
    out, err = io.StringIO(), io.StringIO()
    if stdin is not None:
        sys.stdin = io.StringIO(stdin)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            return 0, generate_main(argv), out.getvalue(), err.getvalue()
        except SystemExit as stop:
            return stop.code, None, out.getvalue(), err.getvalue()


def _tokens(tp, argv, stdin=None):
    ranks = run_ranks(tp, _cli, argv, stdin)
    assert all(r[0] == 0 for r in ranks), ranks[0][3]
    assert all(r[1] == ranks[0][1] for r in ranks), "every TP rank generates the same tokens"
    return [r["tokens"] for r in ranks[0][1]]


def _hf_greedy(hf, ids, stop_at_eod):
    hf.generation_config.eos_token_id = hf.config.eos_token_id if stop_at_eod else None
    out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32, pad_token_id=hf.config.eos_token_id)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_matches_transformers_generate(gpt2, tp):
    checkpoint, hf, tokenizer, prompts = gpt2
    argv = ["--load", checkpoint, "--greedy", "--max-new-tokens", "32", "--ignore-eod"]
    ours = _tokens(tp, argv + [a for p in prompts for a in ("--prompt", p)])  # one batch of 3 lengths
    ids = [tokenizer.tokenize(p) for p in prompts]
    assert len({len(i) for i in ids}) == 3 and all(len(t) == 32 for t in ours)
    assert ours == [_hf_greedy(hf, i, stop_at_eod=False) for i in ids]


def _load(checkpoint, tp):
    bundle = read_consolidated(checkpoint, None)
    model = GPTModel(gpt_config_from_meta(bundle["meta"], checkpoint), init_parallel(tp).tp).eval()
    load_full_weights(model, bundle["model"])
    return model


def _cache_against_recomputation(checkpoint, tp, ids):
    model = _load(checkpoint, tp)
    cache, worst, scale = KVCache(model, 1, len(ids)), 0.0, 0.0
    with torch.no_grad():
        for start, end in [(0, 8)] + [(p, p + 1) for p in range(8, len(ids))]:
            cached = forward_cached(model, torch.tensor([ids[start:end]]), cache)
            full = forward_full(model, torch.tensor([ids[:end]]))
            worst, scale = max(worst, (cached - full).abs().max().item()), max(scale, full.abs().max().item())
    prompts = [ids[:5], ids[:13], ids[:9]]
    runs_ = {(greedy, use_cache): generate(model, prompts, SamplingConfig(32, greedy, 0.9, 50, 0.95, seed=5),
                                          eod=3, use_cache=use_cache)
             for greedy in (True, False) for use_cache in (True, False)}
    return worst / scale, runs_


@pytest.mark.parametrize("tp", [1, 2])
def test_kv_cache_matches_full_recomputation(gpt2, tp):
    checkpoint, _, tokenizer, prompts = gpt2
    ids = tokenizer.tokenize(" ".join(prompts))[:40]
    relative, by_mode = run_ranks(tp, _cache_against_recomputation, checkpoint, tp, ids)[0]
    # fp32: the same maths over other matmul shapes, so sums in another order: ~1.3e-6 of the largest logit seen
    # (a few ulps of this large-weight model's residual stream, max ~30)
    assert relative <= 1e-5
    for greedy in (True, False):
        assert by_mode[(greedy, True)] == by_mode[(greedy, False)]
    assert by_mode[(True, True)] != by_mode[(False, True)]


def test_seeded_sampling_is_the_same_at_every_tp_size(gpt2):
    checkpoint, _, _, prompts = gpt2
    argv = ["--load", checkpoint, "--max-new-tokens", "32", "--seed", "11", *SAMPLING] + \
        [a for p in prompts for a in ("--prompt", p)]
    tp1 = _tokens(1, argv)
    assert _tokens(2, argv) == tp1 == _tokens(1, argv)
    assert _tokens(1, argv[:-len(prompts) * 2] + ["--seed", "12"] + argv[-len(prompts) * 2:]) != tp1


def test_sampling_filters_match_transformers_warpers():
    logits = torch.randn(4, 512, generator=torch.Generator().manual_seed(0)) * 3
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 40, 1.0), (1.3, 0, 0.9), (0.8, 50, 0.95), (1.0, 1, 0.5)]:
        expected = TemperatureLogitsWarper(temperature)(None, logits)
        if top_k:
            expected = TopKLogitsWarper(top_k)(None, expected)
        if top_p < 1:
            expected = TopPLogitsWarper(top_p)(None, expected)
        ours = filter_logits(logits, SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p))
        assert torch.equal(ours, expected)


def _stops(checkpoint, ids, eod):
    """(free-running greedy tokens, the same with `eod` as end-of-document, the new tokens of a 120-token prompt)."""
    model = _load(checkpoint, 1)
    free = generate(model, ids, SamplingConfig(32, greedy=True, stop_at_eod=False), eod=eod)
    new_eod = next(t for i, t in enumerate(free[0]) if i >= 3 and t not in free[0][:i])  # first seen at step >= 3
    stopped = generate(model, ids, SamplingConfig(32, greedy=True), eod=new_eod)
    long_prompt = (sum(ids, []) * 40)[:120]
    return free, new_eod, stopped, generate(model, [long_prompt], SamplingConfig(32, greedy=True), eod=eod)[0]


def test_generation_stops_at_end_of_document_and_at_the_last_position(gpt2):
    checkpoint, _, tokenizer, prompts = gpt2
    free, eod, stopped, at_the_end = run_ranks(1, _stops, checkpoint, [tokenizer.tokenize(p) for p in prompts[:2]],
                                               tokenizer.eod)[0]
    assert stopped[0] == free[0][:free[0].index(eod) + 1]  # the row ends with its end-of-document
    assert stopped[1] == (free[1][:free[1].index(eod) + 1] if eod in free[1] else free[1])  # the other goes on
    assert len(at_the_end) == 8  # 120 + 8 = --max-position-embeddings


def test_prompts_from_file_and_stdin_in_batches(gpt2, tmp_path):
    checkpoint, _, _, prompts = gpt2
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    argv = ["--load", checkpoint, "--max-new-tokens", "8", "--seed", "3", *SAMPLING]
    code, results, _, _ = run_ranks(1, _cli, argv + ["--prompt-file", str(tmp_path / "prompts.txt"), "--batch-size",
                                                    "2", "--output-format", "jsonl", "--output",
                                                    str(tmp_path / "out.jsonl")])[0]
    written = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert code == 0 and written == results and [r["prompt"] for r in written] == prompts
    from_stdin = run_ranks(1, _cli, argv + ["--batch-size", "2"], "\n".join(prompts))[0]
    assert [r["tokens"] for r in from_stdin[1]] == [r["tokens"] for r in results]
    assert from_stdin[2] == "".join(f"{r['prompt']}{r['text']}\n\n" for r in results)
    assert all(r["stop"] in ("max_new_tokens", "end_of_document") for r in results)


def test_generates_text_from_the_zero3_sentencepiece_run(tmp_path_factory):
    trained = runs(tmp_path_factory)
    argv = ["--load", trained.sp.checkpoint, "--greedy", "--max-new-tokens", "16", "--prompt", "The fortune",
            "--prompt", ""]  # an empty prompt starts from end-of-document
    tp1, tp2 = run_ranks(1, _cli, argv)[0], run_ranks(2, _cli, argv)[0]
    assert tp1[0] == 0 and [r["tokens"] for r in tp1[1]] == [r["tokens"] for r in tp2[1]]
    assert tp1[2].startswith("The fortune") and len(tp1[1][0]["tokens"]) >= 1


@pytest.mark.parametrize("extra,message", [
    (["--prompt", "word " * 200], "tokens, and the model sees at most 128 positions (--max-position-embeddings)"),
    (["--prompt", "x", "--top-p", "0"], "--top-p 0.0 is out of range: it must be > 0.0 and <= 1.0"),
    (["--prompt", "x", "--tokenizer-model", "/nonexistent/sp.model", "--tokenizer-type",
      "GPTSentencePieceTokenizer"], "the checkpoint's tokenizer: --tokenizer-model /nonexistent/sp.model does not"),
    (["--prompt", "x", "--tensor-model-parallel-size", "2"], "must equal the number of processes 1"),
])
def test_bad_input_is_one_line_and_writes_nothing(gpt2, tmp_path, extra, message):
    code, _, out, err = run_ranks(1, _cli, ["--load", gpt2[0], "--output", str(tmp_path / "o.txt"), *extra])[0]
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert os.listdir(tmp_path) == []


def test_a_directory_that_is_not_a_checkpoint_is_one_line(tmp_path):
    code, _, _, err = run_ranks(1, _cli, ["--load", str(tmp_path), "--prompt", "x"])[0]
    assert code == 2 and err.count("\n") == 1 and "no mpzero checkpoint under" in err


def test_a_prompt_that_encodes_to_no_tokens_is_one_line(tmp_path):
    """A run on token ids (NullTokenizer: the text is the ids) and a prompt of blanks: no tokens, one line."""
    save = str(tmp_path / "ckpt")
    run_ranks(1, quiet_main, TINY + ["--train-iters", "1", "--eval-iters", "0", "--save", save,
                                     "--tokenizer-type", "NullTokenizer"])
    code, _, out, err = run_ranks(1, _cli, ["--load", save, "--prompt", "   "])[0]
    assert code == 2 and out == "" and err.count("\n") == 1 and "prompt 1 ('   ') encodes to no tokens" in err, err
