"""FP8 against bf16 on the bundled text: the final loss of a small GPT and LLaMA trained in bf16 and in each torchao
recipe (--fp8-format, mpzero/tensor_parallel/fp8.py), and each recipe's difference from bf16. The numerics only:
FP8's speed is the GPU's question (make gpu-check's bench_fp8).

    python -m bench.bench_fp8_loss [--iters 200] [--families gpt llama]

The text is data_sample/'s, tokenized with a 512-token GPT-2 BPE trained here; the runs are
tests/test_fp8_training.py's (micro-batch 4, global batch 8, seq 64, lr 3e-3 cosine), whose `product` test holds
each recipe within 3% of bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import runpy
import tempfile
import time

from tests.test_fp8_training import GPT, LLAMA, RECIPES, _train
from tests.trained_gpt import TOOLS, corpus_texts, gpt2_bpe_files


def text_flags(base: pathlib.Path) -> list[str]:
    texts = corpus_texts(3000)
    (base / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    flags = gpt2_bpe_files(base, texts)
    preprocess = runpy.run_path(os.path.join(TOOLS, "preprocess_data.py"))["main"]
    preprocess(["--input", str(base / "docs.jsonl"), "--output-prefix", str(base / "text"), "--append-eod",
                "--workers", "1", "--no-progress", *flags])
    return flags + ["--data-path", str(base / "text_text_document"), "--split", "98,1,1", "--eval-iters", "0"]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--families", nargs="+", choices=("gpt", "llama"), default=["gpt", "llama"])
    a = p.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="mpzero-bench-fp8-") as base:
        text = text_flags(pathlib.Path(base))
        for family in a.families:
            model = GPT if family == "gpt" else LLAMA
            start = time.perf_counter()
            bf16 = _train(model, text, a.iters, [])[-1]
            print(f"{family} bf16: final loss {bf16:.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
            for recipe, flags in RECIPES.items():
                start = time.perf_counter()
                fp8 = _train(model, text, a.iters, flags)[-1]
                results[(family, recipe)] = fp8
                print(f"{family} {recipe} ({' '.join(flags)}): final loss {fp8:.4f}, {(fp8 - bf16) / bf16:+.2%} of "
                      f"bf16 ({time.perf_counter() - start:.0f} s)", flush=True)
            results[(family, "bf16")] = bf16
    return results


if __name__ == "__main__":
    main()
