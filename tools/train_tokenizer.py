"""Train a SentencePiece tokenizer (BPE by default, or unigram) for GPTSentencePieceTokenizer, or a byte-level BPE
Hugging Face tokenizer.json for HuggingFaceTokenizer, on a JSONL corpus (or parquet files).

    python tools/train_tokenizer.py --input data_sample/kjv_sample.jsonl.gz --vocab-size 8000 \
        --output-prefix data/kjv_tok
    python tools/train_tokenizer.py --tokenizer-type HuggingFaceTokenizer --input data/fineweb/ --vocab-size 32000 \
        --output-prefix data/fw_tok

HuggingFaceTokenizer: writes data/fw_tok/tokenizer.json (`--tokenizer-model data/fw_tok` for the other tools):
GPT-2's byte-level BPE (its regex split, no prefix space, every byte in the base alphabet, so any text encodes and
decodes back unchanged) with `<|endoftext|>` as id 0, the end-of-document token.

GPTSentencePieceTokenizer (the default):
writes data/kjv_tok.model and data/kjv_tok.vocab. Ids: 0 <unk>, 1 <s>, 2 </s> (the end-of-document
token EOD), then 256 byte pieces (byte fallback: any text encodes without <unk>), then the learned
pieces. Text is kept as is (no Unicode normalisation, whitespace and newlines preserved), so
detokenize(tokenize(text)) == text. Every document is one training sentence; the same input and
flags give the same model bytes (for either type).
"""

from __future__ import annotations

import io
import os
import sys


from mpzero.data.jsonl import check_inputs, iter_texts
from mpzero.cli import INPUT_ERRORS, OUTPUT_PREFIX, Number, Parser, Text, exit_code
from mpzero.errors import ConfigError, shorten
from mpzero.files import write_atomically

_MAX_DOCUMENT_BYTES = 1 << 20  # longer documents are left out of training (SentencePiece's own limit is 4 KB)


def parse_args(argv):
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--input", type=Text(), nargs="+", required=True,
                   help="JSONL file(s), optionally .gz, and/or parquet files, directories of them or globs")
    p.add_argument("--tokenizer-type", choices=["GPTSentencePieceTokenizer", "HuggingFaceTokenizer"],
                   default="GPTSentencePieceTokenizer",
                   help="what to train: a SentencePiece PREFIX.model, or a byte-level BPE PREFIX/tokenizer.json")
    p.add_argument("--json-keys", type=Text(), nargs="+", default=["text"])
    p.add_argument("--vocab-size", type=Number(int, low=1), required=True)
    p.add_argument("--output-prefix", type=OUTPUT_PREFIX, required=True,
                   help="writes PREFIX.model and PREFIX.vocab (SentencePiece), or PREFIX/tokenizer.json")
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe", help="SentencePiece's model type")
    p.add_argument("--character-coverage", type=Number(float, low=0.0, low_ok=False, high=1.0, high_ok=True),
                   default=1.0,
                   help="share of characters given their own piece; the rest fall back to bytes")
    p.add_argument("--skip-malformed", action="store_true", help="skip and count malformed lines")
    return p.parse_args(argv)


def train(args) -> tuple[bytes, int]:
    """The serialized model and how many malformed lines were skipped."""
    import sentencepiece as spm

    check_inputs(args.input)
    if args.vocab_size < 300:
        raise ConfigError(f"--vocab-size {args.vocab_size} is too small: 3 special + 256 byte pieces come "
                          f"first, so use at least 300 (thousands for real text)")
    skipped: list[str] = []
    failures: list[ConfigError] = []

    counted = [0]

    def texts():  # SentencePiece would wrap our error in its own: keep it, end the input early
        try:
            yield from _counted(iter_texts(args.input, args.json_keys, args.skip_malformed, skipped), counted)
        except ConfigError as exc:
            failures.append(exc)

    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=texts(), model_writer=model, vocab_size=args.vocab_size,
            model_type=args.model_type, character_coverage=args.character_coverage, byte_fallback=True,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            max_sentence_length=_MAX_DOCUMENT_BYTES, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            input_sentence_size=0, minloglevel=2)  # input_sentence_size=0: every document, no sampling
    except RuntimeError as exc:  # e.g. a vocabulary larger than the corpus can fill
        if not failures and counted[0]:
            raise ConfigError(f"SentencePiece training failed: {str(exc).strip().splitlines()[-1]}") from None
    if failures:
        raise failures[0]
    _check_some_text(args, counted[0], skipped)
    return model.getvalue(), len(skipped)


def _counted(texts, counted: list[int]):
    """The texts, counting those that are not empty into counted[0]."""
    for text in texts:
        counted[0] += bool(text)
        yield text


def _check_some_text(args, documents: int, skipped: list[str]) -> None:
    """A tokenizer trained on no text has no merges and tokenizes everything to bytes: refused."""
    if not documents:
        why = f"all {len(skipped)} lines were malformed and skipped" if skipped else "it holds no documents"
        raise ConfigError(f"--input {shorten(' '.join(args.input), 120)} gives no text to train on ({why}): give a "
                          f"corpus with text under --json-keys {' '.join(args.json_keys)}")


HF_EOD = "<|endoftext|>"


def train_hf(args) -> tuple[str, int]:
    """A byte-level BPE tokenizer.json (its JSON text) and how many malformed lines were skipped."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_inputs(args.input)
    if args.vocab_size < 300:
        raise ConfigError(f"--vocab-size {args.vocab_size} is too small: {HF_EOD} and 256 byte tokens come first, "
                          f"so use at least 300 (thousands for real text)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=[HF_EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    skipped: list[str] = []
    counted = [0]
    tokenizer.train_from_iterator(_counted(iter_texts(args.input, args.json_keys, args.skip_malformed, skipped),
                                           counted), trainer)
    _check_some_text(args, counted[0], skipped)
    return tokenizer.to_str(), len(skipped)


def main(argv=None) -> int:
    args = parse_args(argv)
    write = _train_and_write_hf if args.tokenizer_type == "HuggingFaceTokenizer" else _train_and_write
    return exit_code(lambda: write(args), INPUT_ERRORS)


def _train_and_write_hf(args) -> None:
    text, skipped = train_hf(args)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(text)
    os.makedirs(args.output_prefix, exist_ok=True)
    path = os.path.join(args.output_prefix, "tokenizer.json")
    write_atomically(path, text)
    print(f"wrote {path} ({tokenizer.get_vocab_size()} tokens, EOD {HF_EOD} id {tokenizer.token_to_id(HF_EOD)})"
          + (f"; skipped {skipped} malformed lines" if skipped else ""))


def _train_and_write(args) -> None:
    model, skipped = train(args)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model)
    vocab = "".join(f"{sp.IdToPiece(i)}\t{sp.GetScore(i):g}\n" for i in range(sp.GetPieceSize()))
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    write_atomically(args.output_prefix + ".vocab", vocab)
    write_atomically(args.output_prefix + ".model", model)  # last: a .model present means both are complete
    print(f"wrote {args.output_prefix}.model ({sp.GetPieceSize()} pieces, EOD id {sp.eos_id()})"
          + (f"; skipped {skipped} malformed lines" if skipped else ""))


if __name__ == "__main__":
    sys.exit(main())
