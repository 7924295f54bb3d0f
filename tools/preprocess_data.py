"""Tokenize a JSONL corpus into Megatron's indexed-dataset format, with Megatron's flag names.

    python tools/preprocess_data.py --input data_sample/kjv_sample.jsonl.gz --output-prefix data/kjv \
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model data/kjv_tok.model \
        --append-eod --workers 2

writes data/kjv_text_document.bin/.idx (one pair per --json-keys key), usable as `--data-path
data/kjv_text_document` here and in Megatron-LM. Input: one JSON object per line, plain or .gz, or parquet
files (`--input data/fineweb/` or a quoted glob: every .parquet file, sorted; the --json-keys columns are read;
pip install -e '.[parquet]'); a malformed line or row stops the run with its file and line (row) unless
--skip-malformed is given. A Hugging Face tokenizer.json: --tokenizer-type HuggingFaceTokenizer
--tokenizer-model DIR_OR_FILE. Progress
(MB/s, documents/s, tokens) goes to stderr; outputs appear only once complete. Ctrl-C or SIGTERM
removes the temporary files and exits with one line (code 128 + signal number); temporary files of a
run killed outright are removed by the next run of the same --output-prefix.
"""

from __future__ import annotations

import sys


from mpzero.data.preprocess import PreprocessConfig, output_prefix_for, preprocess
from mpzero.data.interrupts import Interrupted, signals_as_interrupts
from mpzero.cli import INPUT_ERRORS, OUTPUT_PREFIX, Number, Parser, Text, add_tokenizer_flags, exit_code, print_error


def parse_args(argv):
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--input", type=Text(), nargs="+", required=True,
                   help="JSONL file(s), optionally .gz, and/or parquet files, directories of them or globs, read in "
                        "order")
    p.add_argument("--output-prefix", type=OUTPUT_PREFIX, required=True)
    p.add_argument("--json-keys", type=Text(), nargs="+", default=["text"])
    add_tokenizer_flags(p, None, required=True)
    p.add_argument("--vocab-size", type=Number(int, low=1), help="NullTokenizer only")
    p.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    p.add_argument("--workers", type=Number(int, low=1), default=1, help="tokenizing processes (1: in this process)")
    p.add_argument("--log-interval", type=Number(int, low=1), default=1000,
                   help="refresh the rates every N documents")
    p.add_argument("--skip-malformed", action="store_true", help="skip and count malformed lines")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (the summary still prints)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    tokenizer = {"tokenizer_type": args.tokenizer_type, "tokenizer_model": args.tokenizer_model,
                 "vocab_file": args.vocab_file, "merge_file": args.merge_file, "vocab_size": args.vocab_size}
    cfg = PreprocessConfig(args.input, args.output_prefix, args.json_keys, tokenizer, args.append_eod,
                           args.workers, max(args.log_interval, 1), args.skip_malformed)
    try:
        with signals_as_interrupts():  # SIGTERM like Ctrl-C: temporary files removed, one line, exit 128 + signal
            return exit_code(lambda: _report(preprocess(cfg, progress=not args.no_progress), args), INPUT_ERRORS)
    except Interrupted as stop:
        print_error(f"{stop}: nothing written to {args.output_prefix}_*_document and its temporary files removed; "
                    f"run the same command again")
        return 128 + stop.signum


def _report(stats, args) -> None:
    seconds = max(stats.seconds, 1e-9)
    for key in args.json_keys:
        print(f"wrote {output_prefix_for(args.output_prefix, key)}.bin/.idx")
    print(f"{stats.documents} documents, {stats.tokens} tokens, {stats.bytes / 2**20:.1f} MB in {seconds:.1f} s "
          f"({stats.documents / seconds:.0f} docs/s, {stats.bytes / 2**20 / seconds:.2f} MB/s, "
          f"{stats.tokens / seconds:.0f} tokens/s)")
    if stats.skipped:
        print(f"skipped {stats.skipped} malformed lines (first: {stats.first_skipped})")


if __name__ == "__main__":
    sys.exit(main())
