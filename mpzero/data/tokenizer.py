"""Tokenizers under Megatron's `--tokenizer-type` names, all with one small interface:

    tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model="kjv.model")
    tok.vocab_size, tok.eod, tok.tokenize(text) -> list[int], tok.detokenize(ids) -> str
    tok.tokenize_batch(texts) -> list[np.ndarray]  # the same ids, one integer array per text

- `GPTSentencePieceTokenizer`: a SentencePiece model used for GPT. No BOS/EOS is added to a document;
  the end-of-document id is the model's end-of-sentence id; the vocabulary is the model's size.
- `GPT2BPETokenizer`: GPT-2's byte-level BPE from a local `vocab.json` + `merges.txt` (HF `tokenizers`
  runs it; nothing is ever downloaded). EOD is `<|endoftext|>`; the vocabulary is vocab.json's size.
- `HuggingFaceTokenizer`: any Hugging Face `tokenizer.json` (Llama 3, SmolLM, Mistral, or one trained by
  tools/train_tokenizer.py), `--tokenizer-model` naming the file or its directory; run by `tokenizers`, from the
  local file only. No special token is added to a document (no BOS). EOD is the tokenizer's end-of-text token:
  the directory's tokenizer_config.json `eos_token` where there is one, else the first of `<|endoftext|>`,
  `<|end_of_text|>`, `</s>`, `<eos>` it has. The vocabulary is its largest id + 1 (added tokens included).
- `NullTokenizer`: text is already whitespace-separated ids; EOD = `vocab_size` (one extra id).
"""

from __future__ import annotations

import json
import os

import numpy as np

from mpzero.errors import ConfigError

TOKENIZER_TYPES = ("GPTSentencePieceTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer")


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None = None, vocab_file: str | None = None,
                    merge_file: str | None = None, vocab_size: int | None = None):
    """The tokenizer named by `tokenizer_type`, checking that the files it needs were given and exist."""
    if tokenizer_type == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(_existing(tokenizer_model, "--tokenizer-model", tokenizer_type))
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(_existing(vocab_file, "--vocab-file", tokenizer_type),
                                _existing(merge_file, "--merge-file", tokenizer_type))
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise ConfigError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json or "
                              "its directory)")
        if os.path.isdir(tokenizer_model):
            tokenizer_model = os.path.join(tokenizer_model, "tokenizer.json")
        return HuggingFaceTokenizer(_existing(tokenizer_model, "--tokenizer-model", tokenizer_type))
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None or vocab_size < 1:
            raise ConfigError("NullTokenizer needs --vocab-size (a positive number of token ids)")
        return NullTokenizer(vocab_size)
    raise ConfigError(f"unknown --tokenizer-type {tokenizer_type!r}: choose one of {', '.join(TOKENIZER_TYPES)}")


def _existing(path: str | None, flag: str, tokenizer_type: str) -> str:
    if not path:
        raise ConfigError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path} does not exist: check the path")
    return path


class GPTSentencePieceTokenizer:
    def __init__(self, model_file: str):
        import sentencepiece  # imported here: the other tokenizers do not need it

        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(model_file)
        except (OSError, RuntimeError) as exc:
            raise ConfigError(f"--tokenizer-model {model_file} is not a SentencePiece model ({exc}): "
                              f"train one with tools/train_tokenizer.py") from None
        if self._sp.eos_id() < 0:
            raise ConfigError(f"--tokenizer-model {model_file} has no end-of-sentence piece to use as "
                              f"end-of-document: retrain it with tools/train_tokenizer.py")
        self.vocab_size = self._sp.GetPieceSize()
        self.eod = self._sp.eos_id()
        self.files = (model_file,)  # what defines it: hashed into the checkpoint's record (tokenizer_identity.py)

    def tokenize(self, text: str) -> list[int]:
        return self._sp.EncodeAsIds(text)

    def tokenize_batch(self, texts: list[str]) -> list[np.ndarray]:
        # One C++ call for many texts, returning int32 arrays: ~4% faster than tokenize() per text
        # plus list -> array (bench/README.md at 5a79686). One thread: preprocessing's workers are the parallelism.
        return self._sp.encode(texts, out_type="numpy", num_threads=1)

    def detokenize(self, ids) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])


class _TokenizersLibrary:
    """Encoding and decoding through a `tokenizers.Tokenizer` (`self._tok`), special tokens as plain text."""

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.array(self.tokenize(t), dtype=np.int64) for t in texts]  # encode_batch would start threads

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class GPT2BPETokenizer(_TokenizersLibrary):
    _EOD_TOKEN = "<|endoftext|>"

    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        try:
            bpe = models.BPE.from_file(vocab_file, merge_file)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception on a bad file
            raise ConfigError(f"cannot read GPT-2 BPE files --vocab-file {vocab_file} / --merge-file "
                              f"{merge_file} ({exc}): pass GPT-2 style vocab.json and merges.txt") from None
        self._tok = Tokenizer(bpe)
        # GPT-2's own pre-tokenization: its regex split, bytes mapped to printable characters, no prefix space.
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        self._tok.decoder = decoders.ByteLevel()
        vocab = self._tok.get_vocab()
        if self._EOD_TOKEN not in vocab:
            raise ConfigError(f"--vocab-file {vocab_file} has no {self._EOD_TOKEN} entry for end-of-document")
        self.vocab_size = len(vocab)
        self.eod = vocab[self._EOD_TOKEN]
        self.files = (vocab_file, merge_file)


class HuggingFaceTokenizer(_TokenizersLibrary):
    EOD_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")

    def __init__(self, tokenizer_file: str):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(tokenizer_file)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception on a bad file
            raise ConfigError(f"--tokenizer-model {tokenizer_file} is not a Hugging Face tokenizer.json "
                              f"({str(exc).splitlines()[0][:200]}): train one with tools/train_tokenizer.py "
                              f"--type hf-bpe") from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        config_file = os.path.join(os.path.dirname(tokenizer_file), "tokenizer_config.json")
        eos = _config_eos_token(config_file)
        candidates = (eos,) if eos else self.EOD_TOKENS
        found = [token for token in candidates if token in vocab]
        if not found:
            raise ConfigError(f"--tokenizer-model {tokenizer_file} has no end-of-text token for end-of-document "
                              f"(looked for {', '.join(candidates)}): add one as a special token")
        self.vocab_size = max(vocab.values()) + 1
        self.eod, self.eod_token = vocab[found[0]], found[0]
        self.files = (tokenizer_file,) + ((config_file,) if eos else ())  # what defines the ids and the EOD


def _config_eos_token(path: str) -> str | None:
    """tokenizer_config.json's eos_token (a string, or {"content": ...}), None without the file or the key."""
    try:
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError) as error:
        raise ConfigError(f"{path} is unreadable ({error}): fix or remove it") from None
    return eos.get("content") if isinstance(eos, dict) else eos if isinstance(eos, str) else None


class NullTokenizer:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size + 1
        self.eod = vocab_size
        self.files = ()  # the ids are the text: the vocabulary size defines it

    def tokenize(self, text: str) -> list[int]:
        ids = [int(t) for t in text.split()]  # ValueError for a word that is not an integer
        if any(not 0 <= i < self.eod for i in ids):
            raise ValueError(f"token ids must lie in [0, {self.eod})")
        return ids

    def tokenize_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.array(self.tokenize(t), dtype=np.int64) for t in texts]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)
