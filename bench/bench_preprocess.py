"""Preprocessing throughput: tools/preprocess_data.py's pipeline with 1 and 2 workers against the raw
SentencePiece encode rate, all measured in this run on the same text and tokenizer.

    python bench/bench_preprocess.py [--corpus DIR] [--repeat 3]    # DIR of *.jsonl(.gz): the bundled KJV sample
                                                                     # (data_sample/) by default

Raw encode: every document already decoded in memory, encoded one by one in one thread: the
tokenizer's own speed, with no file reading, JSON parsing or writing (the goal's baseline). Raw batch
encode: the same through `tokenize_batch` (SentencePiece's batch API, one thread), 128 documents a call
as the pipeline does, shown so the pipeline's overhead over its own tokenizer call is visible too.
Pipeline: the real thing, from
JSONL on disk to .bin/.idx (worker start-up included). Each figure is the best of --repeat runs.
Goals: 2 workers >= 1.8x 1 worker; 1 worker >= 0.9x raw encode.

Parquet against JSONL: the same documents (the corpus --format-copies times over, so that starting up, e.g.
importing pyarrow, ~0.15 s, weighs as little as on a real corpus) written here as plain JSONL and as parquet
(pyarrow's defaults: snappy, row groups of 1024 rows, as FineWeb's files are laid out), each preprocessed with 1
and 2 workers:
documents/s and MB/s of document text (the UTF-8 bytes of the texts, the same for both formats, so the rates
compare). Goal: parquet no slower than JSONL. Needs pyarrow (`pip install -e '.[parquet]'`); skipped without it.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import sys
import tempfile
import time


from mpzero.data.preprocess import PreprocessConfig, preprocess
from mpzero.data.tokenizer import build_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_tokenizer(inputs: list[str], vocab_size: int, prefix: str) -> str:
    import runpy

    main = runpy.run_path(os.path.join(ROOT, "tools", "train_tokenizer.py"))["main"]
    if main(["--input", *inputs, "--vocab-size", str(vocab_size), "--output-prefix", prefix]) != 0:
        raise SystemExit("tokenizer training failed")
    return prefix + ".model"


def _texts(inputs: list[str]) -> list[str]:
    texts = []
    for path in inputs:
        with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
            texts += [json.loads(line)["text"] for line in f]
    return texts


def raw_encode_rate(inputs: list[str], model: str) -> tuple[float, int]:
    tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model)
    texts = _texts(inputs)
    start, tokens = time.perf_counter(), 0
    for text in texts:
        tokens += len(tok.tokenize(text))
    return tokens / (time.perf_counter() - start), tokens


def raw_batch_encode_rate(inputs: list[str], model: str, batch: int = 128) -> tuple[float, int]:
    tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model)
    texts = _texts(inputs)
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(texts), batch):
        tokens += sum(len(ids) for ids in tok.tokenize_batch(texts[i:i + batch]))
    return tokens / (time.perf_counter() - start), tokens


def pipeline_rate(inputs: list[str], model: str, workers: int, out_dir: str) -> tuple[float, int]:
    tokenizer = {"tokenizer_type": "GPTSentencePieceTokenizer", "tokenizer_model": model}
    cfg = PreprocessConfig(inputs, os.path.join(out_dir, f"w{workers}"), ["text"], tokenizer,
                           append_eod=True, workers=workers)
    stats = preprocess(cfg, progress=False)
    return stats.tokens / stats.seconds, stats.tokens


def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def format_rates(texts: list[str], model: str, tmp: str, repeat: int) -> dict:
    """{(format, workers): (documents/s, text MB/s, documents per CPU-second)}, each the best of `repeat`
    interleaved runs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = {"jsonl": os.path.join(tmp, "docs.jsonl"), "parquet": os.path.join(tmp, "docs.parquet")}
    with open(paths["jsonl"], "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    pq.write_table(pa.table({"text": texts}), paths["parquet"], row_group_size=1024)
    text_mb = sum(len(t.encode("utf-8")) for t in texts) / 2**20
    tokenizer = {"tokenizer_type": "GPTSentencePieceTokenizer", "tokenizer_model": model}
    best = {}
    for _ in range(repeat):
        for fmt, path in paths.items():
            for workers in (1, 2):
                cfg = PreprocessConfig([path], os.path.join(tmp, f"{fmt}{workers}"), ["text"], tokenizer,
                                       append_eod=True, workers=workers)
                cpu = _cpu_seconds()
                stats = preprocess(cfg, progress=False)  # the pool's workers are joined (reaped) when it returns
                cpu = _cpu_seconds() - cpu
                rate = (stats.documents / stats.seconds, text_mb / stats.seconds, stats.documents / cpu)
                old = best.get((fmt, workers), rate)
                best[fmt, workers] = tuple(max(a, b) for a, b in zip(old, rate))
    return best


def _print_formats(best: dict) -> None:
    for (fmt, workers), (docs, mb, per_cpu) in sorted(best.items()):
        print(f"{fmt:>8}, {workers} worker(s): {docs:8.0f} docs/s, {mb:6.2f} MB/s of text, "
              f"{per_cpu:6.0f} docs per CPU-second")
    for workers in (1, 2):
        wall = best["parquet", workers][0] / best["jsonl", workers][0]
        cpu = best["parquet", workers][2] / best["jsonl", workers][2]
        print(f"parquet / JSONL at {workers} worker(s): {wall:.2f}x docs/s, {cpu:.2f}x docs per CPU-second "
              f"(goal >= 1.00x, within noise) {'met' if max(wall, cpu) >= 0.97 else 'MISSED'}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpus", default=os.path.join(ROOT, "data_sample"),
                   help="a directory of *.jsonl / *.jsonl.gz files (default: the repository's bundled sample)")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--format-copies", type=int, default=4, help="parquet vs JSONL: the corpus this many times")
    args = p.parse_args(argv)
    inputs = sorted(glob.glob(os.path.join(args.corpus, "*.jsonl")) + glob.glob(os.path.join(args.corpus, "*.jsonl.gz")))
    if not inputs:
        print(f"error: no *.jsonl or *.jsonl.gz files in {args.corpus}: pass --corpus", file=sys.stderr)
        return 2
    size = sum(os.path.getsize(p) for p in inputs) / 2**20
    print(f"corpus: {len(inputs)} files, {size:.1f} MB ({', '.join(os.path.basename(p) for p in inputs)}); "
          f"cpus: {os.cpu_count()}; load average before: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        model = train_tokenizer(inputs, args.vocab_size, os.path.join(tmp, "tok"))
        best = {"raw encode": 0.0, "raw batch": 0.0, "1 worker": 0.0, "2 workers": 0.0}
        for _ in range(args.repeat):  # interleaved, so a burst of outside load hits every variant alike
            best["raw encode"] = max(best["raw encode"], raw_encode_rate(inputs, model)[0])
            best["raw batch"] = max(best["raw batch"], raw_batch_encode_rate(inputs, model)[0])
            best["1 worker"] = max(best["1 worker"], pipeline_rate(inputs, model, 1, tmp)[0])
            best["2 workers"] = max(best["2 workers"], pipeline_rate(inputs, model, 2, tmp)[0])
    for name, rate in best.items():
        print(f"{name:>10}: {rate / 1e6:6.3f} M tokens/s")
    two_vs_one = best["2 workers"] / best["1 worker"]
    one_vs_raw = best["1 worker"] / best["raw encode"]
    print(f"2 workers / 1 worker: {two_vs_one:.2f}x (goal >= 1.80x) {'met' if two_vs_one >= 1.8 else 'MISSED'}")
    print(f"1 worker / raw encode: {one_vs_raw:.2f}x (goal >= 0.90x) {'met' if one_vs_raw >= 0.9 else 'MISSED'}")
    print(f"1 worker / raw batch encode: {best['1 worker'] / best['raw batch']:.2f}x (no goal: the pipeline's "
          f"own overhead)")
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        print("parquet / JSONL: skipped (pyarrow is not installed: pip install -e '.[parquet]')")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model = train_tokenizer(inputs, args.vocab_size, os.path.join(tmp, "tok"))
        _print_formats(format_rates(_texts(inputs) * args.format_copies, model, tmp, args.repeat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
