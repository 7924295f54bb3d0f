"""Two small GPTs trained by pretrain_gpt.py on real text, for the export, import and generation tests.

- `bpe`: a GPT-2 byte-level BPE tokenizer (trained here with HF `tokenizers`), TP 1, `--openai-gelu`,
  `--untie-embeddings-and-output-weights`, no dropout.
- `sp`: a SentencePiece tokenizer (tools/train_tokenizer.py), TP 2 x DP 2 under ZeRO-3, erf GELU, tied output
  weights, Megatron's default dropout.
Both: 2 layers, hidden 64, 4 heads, trained on 64-token windows with 128 positions, so prompts plus 32 new tokens
fit. Built once per test session (`runs(tmp_path_factory)`), about 10 s on 2 cores. `mpzero_logits` reads any
checkpoint's logits at a TP size, as the export and import tests compare them.
"""

from __future__ import annotations

import gzip
import json
import os
import runpy
from dataclasses import dataclass

import torch

from mpzero.checkpointing.consolidated import read_consolidated
from mpzero.inference import gpt_config_from_meta, load_full_weights
from mpzero.models import GPTModel
from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import gather_from_tp
from tests.cli import ROOT, quiet_main
from tests.distributed import run_ranks

CORPUS = os.path.join(ROOT, "data_sample", "kjv_sample.jsonl.gz")  # shipped in the repository: public domain
TOOLS = os.path.join(ROOT, "tools")
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "128"]
TRAIN = ["--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "30", "--lr", "1e-2",
         "--min-lr", "1e-3", "--lr-decay-style", "cosine", "--lr-warmup-iters", "4", "--log-interval", "30",
         "--eval-interval", "1000", "--eval-iters", "1", "--split", "98,1,1", "--save-interval", "30"]
_RUNS: dict = {}


@dataclass(frozen=True)
class Run:
    checkpoint: str
    tokenizer_flags: tuple[str, ...]  # as pretrain_gpt.py takes them


@dataclass(frozen=True)
class Runs:
    bpe: Run
    sp: Run
    texts: tuple[str, ...]  # held-out real text (not in the training documents)


def mpzero_logits(checkpoint: str, id_lists, tp: int) -> list[torch.Tensor]:
    """Full-vocabulary logits [s, V] of each token list, from the checkpoint loaded at TP `tp` (on every rank)."""
    bundle = read_consolidated(checkpoint, None)
    groups = init_parallel(tp)
    model = GPTModel(gpt_config_from_meta(bundle["meta"], checkpoint), groups.tp).eval()
    load_full_weights(model, bundle["model"])
    with torch.no_grad():
        return [gather_from_tp(model(torch.tensor([ids])), groups.tp)[0, :, :model.config.vocab_size]
                for ids in id_lists]


def corpus_texts(n: int, skip: int = 0) -> list[str]:
    """Texts [skip, skip + n) of the bundled KJV sample cut into sentences (about 30,000, of ~130 characters):
    short documents, as many as the tests take."""
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        chapters = [json.loads(line)["text"] for line in f]
    sentences = [part.strip() + "." for text in chapters for part in text.split(". ") if part.strip()]
    return sentences[skip:skip + n]


def runs(tmp_path_factory) -> Runs:
    """The two trained checkpoints, made on first use in this session."""
    key = str(tmp_path_factory.getbasetemp())
    if key not in _RUNS:
        _RUNS[key] = _train(tmp_path_factory.mktemp("trained_gpt"))
    return _RUNS[key]


def _train(base) -> Runs:
    docs = base / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_texts(3000)))
    bpe_flags = gpt2_bpe_files(base, corpus_texts(3000))
    sp_flags = _sentencepiece(base, docs)
    preprocess = runpy.run_path(os.path.join(TOOLS, "preprocess_data.py"))["main"]
    for name, flags in (("bpe", bpe_flags), ("sp", sp_flags)):
        assert preprocess(["--input", str(docs), "--output-prefix", str(base / name), "--append-eod",
                           "--workers", "1", "--no-progress", *flags]) == 0
    bpe = Run(str(base / "ckpt_bpe"), tuple(bpe_flags))
    run_ranks(1, quiet_main, MODEL + TRAIN + list(bpe_flags) + [
        "--data-path", str(base / "bpe_text_document"), "--save", bpe.checkpoint, "--openai-gelu",
        "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0"])
    sp = Run(str(base / "ckpt_sp"), tuple(sp_flags))
    run_ranks(4, quiet_main, MODEL + TRAIN + list(sp_flags) + [
        "--data-path", str(base / "sp_text_document"), "--save", sp.checkpoint, "--tensor-model-parallel-size",
        "2", "--zero-stage", "3"], deadline=240)
    return Runs(bpe, sp, tuple(corpus_texts(8, skip=5000)))


def gpt2_bpe_files(base, texts: list[str]) -> list[str]:
    """A GPT-2 style vocab.json + merges.txt (byte-level BPE, <|endoftext|>) of 512 tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    (base / "bpe").mkdir()
    tokenizer.model.save(str(base / "bpe"))
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(base / "bpe" / "vocab.json"),
            "--merge-file", str(base / "bpe" / "merges.txt")]


def _sentencepiece(base, docs) -> list[str]:
    train_tokenizer = runpy.run_path(os.path.join(TOOLS, "train_tokenizer.py"))["main"]
    assert train_tokenizer(["--input", str(docs), "--vocab-size", "512", "--output-prefix", str(base / "sp")]) == 0
    return ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", str(base / "sp.model")]
