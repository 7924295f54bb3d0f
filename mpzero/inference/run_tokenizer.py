"""The tokenizer a checkpoint's run trained with, found from its saved flags (meta.json "config").

The flags hold the paths as the run was given them: relative ones are tried from the current directory, then
from the run's own directory (where its --save path, relative too, leads to --load), then from --load;
`overrides` (the tools' own --tokenizer-* flags) replace them. A run
on --mock-data (no tokenizer) reads and writes token ids, as NullTokenizer, its last id the end-of-document.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from mpzero.data import NullTokenizer, build_tokenizer, describe_tokenizer, same_tokenizer, tokenizer_identity
from mpzero.errors import ConfigError

FILE_FLAGS = ("tokenizer_model", "vocab_file", "merge_file")


@dataclass(frozen=True)
class RunTokenizer:
    tokenizer_type: str | None  # None: --mock-data
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None

    def build(self, vocab_size: int, meta: dict | None = None, directory: str = "the checkpoint"):
        """The tokenizer, checked to have the model's vocabulary (`vocab_size`, before padding) and, where the
        checkpoint's meta.json records the files its run trained with (`meta["tokenizer"]`), to be those files."""
        if self.tokenizer_type in (None, "NullTokenizer"):
            return NullTokenizer(vocab_size - 1)  # ids [0, vocab_size), the last one end-of-document
        try:
            tokenizer = build_tokenizer(self.tokenizer_type, self.tokenizer_model, self.vocab_file, self.merge_file)
        except ConfigError as error:
            raise ConfigError(f"the checkpoint's tokenizer: {error} (pass --tokenizer-model, or --vocab-file and "
                              f"--merge-file, to point at the run's files)") from None
        if tokenizer.vocab_size != vocab_size:
            raise ConfigError(f"the tokenizer ({self.describe()}) has {tokenizer.vocab_size} tokens and the "
                              f"checkpoint's model {vocab_size}: pass the files the run trained with")
        _check_recorded(tokenizer, self, (meta or {}).get("tokenizer"), directory)
        return tokenizer

    def describe(self) -> str:
        files = [getattr(self, name) for name in FILE_FLAGS if getattr(self, name)]
        return f"{self.tokenizer_type or 'token ids'}{' ' + ', '.join(files) if files else ''}"


def _check_recorded(tokenizer, run_tok: RunTokenizer, recorded, directory: str) -> None:
    """The files read are the ones the checkpoint records (by sha256): a tokenizer.json replaced at the recorded
    path by another of the same vocabulary size would otherwise tokenize the prompts, or be exported, silently."""
    here = tokenizer_identity(tokenizer)
    if not isinstance(recorded, dict) or not recorded.get("sha256") or here["sha256"] is None:
        return  # a checkpoint from before the record, ids (mock data or NullTokenizer): nothing to compare
    if not same_tokenizer(recorded, here):
        raise ConfigError(f"the tokenizer {run_tok.describe()} ({describe_tokenizer(here)}) is not the one checkpoint "
                          f"{directory} was trained with ({describe_tokenizer(recorded)}): the file was replaced or "
                          f"another one given; pass the run's own with --tokenizer-model (or --vocab-file and "
                          f"--merge-file)")


def run_tokenizer(flags: dict, load: str, overrides: dict | None = None) -> RunTokenizer:
    """The run's tokenizer from its flags; `overrides` {flag name: value or None} win where given."""
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    chosen = {name: overrides.get(name, flags.get(name)) for name in ("tokenizer_type",) + FILE_FLAGS}
    if "tokenizer_type" in overrides:  # another tokenizer: none of the run's files
        chosen.update({name: overrides.get(name) for name in FILE_FLAGS})
    for name in FILE_FLAGS:
        path = chosen[name]
        if path and name not in overrides and not os.path.exists(path) and not os.path.isabs(path):
            found = [p for p in (os.path.join(d, path) for d in _run_directories(flags, load)) if os.path.exists(p)]
            chosen[name] = found[0] if found else path
    return RunTokenizer(**chosen)


def _run_directories(flags: dict, load: str) -> list[str]:
    """Where the run's relative paths may start: its working directory, when its --save path (relative)
    is the tail of `load`, and `load` itself."""
    load = os.path.abspath(load)
    save = flags.get("save")
    candidates = []
    if isinstance(save, str) and save and not os.path.isabs(save):
        tail = os.path.normpath(save)
        if load.endswith(os.sep + tail):
            candidates.append(load[:-len(tail) - 1])
    return candidates + [load]
