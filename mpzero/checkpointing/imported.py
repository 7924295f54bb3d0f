"""A model brought in from another framework, written as an mpzero checkpoint: the checks on --save made before
any work, and the one write that makes --save appear complete or not at all. tools/import_hf.py and
tools/import_megatron.py write through these.

    check_import_destination(save, {"--input": input_dir})   # at start: one ConfigError line if --save is unusable
    write_imported(save, weights, flags, {"vocab.json": path, ...})
"""

from __future__ import annotations

import os
import shutil

import torch

from mpzero.checkpointing.consolidated import save_weights_only
from mpzero.checkpointing.outputs import check_apart_from_checkpoints
from mpzero.errors import ConfigError
from mpzero.files import (check_parents_creatable, copy_atomically, directory_beside, make_parents,
                          replace_output_directory)


def check_import_destination(save: str, inputs: dict[str, str]) -> None:
    """--save is new or an empty directory, apart from every checkpoint and from the `inputs` ({flag: path}), and
    its missing parents can be made; else one ConfigError line."""
    if os.path.lexists(save) and (not os.path.isdir(save) or os.path.islink(save) or os.listdir(save)):
        raise ConfigError(f"--save {save} already exists and is not empty: choose a new directory")
    check_apart_from_checkpoints(save, "--save", inputs)
    check_parents_creatable(save, "--save")


def write_imported(save: str, weights: dict[str, torch.Tensor], flags: dict, tokenizer_files: dict[str, str],
                   tokenizer: dict | None = None) -> None:
    """A weights-only checkpoint (iteration 0) of `weights` (full tensors by mpzero parameter name) whose meta.json
    states `flags` (the model's pretrain_gpt.py flags by name) and `tokenizer` (its files' record, as a trained
    checkpoint's: mpzero.data.tokenizer_identity), with `tokenizer_files` ({name: source path}) copied to
    SAVE/tokenizer/. Written beside --save under a fresh name (its missing parents made) and renamed into place."""
    make_parents(save)
    tmp = directory_beside(save)  # a fresh name: never a directory of the user's
    try:
        if tokenizer_files:
            os.makedirs(os.path.join(tmp, "tokenizer"))
        for name, source in tokenizer_files.items():
            copy_atomically(source, os.path.join(tmp, "tokenizer", name))
        save_weights_only({"model": weights, "meta": {"config": flags, "tokenizer": tokenizer}}, tmp)
        replace_output_directory(tmp, save)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
