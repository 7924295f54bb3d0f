"""Import a local Hugging Face GPT-2, Llama, Mixtral or Qwen3-MoE directory (`save_pretrained`) as an mpzero checkpoint.

    python tools/import_hf.py --input hf/gpt2 --save checkpoints/gpt2
    torchrun --nproc_per_node 4 pretrain_gpt.py --load checkpoints/gpt2 --finetune --save checkpoints/ft \
        --tensor-model-parallel-size 2 ...   # the model flags this command prints, then your data and schedule

Reads config.json and model.safetensors (or a sharded model.safetensors.index.json, or pytorch_model.bin);
nothing is downloaded. Writes a weights-only checkpoint (iteration 0, as tools/checkpoint_util.py
from-consolidated does) whose meta.json states the model, so `--load ... --finetune` continues from it at any
TP x DP x ZeRO layout with the same logits, and tools/generate.py and tools/export_hf.py read it. The tokenizer
files (vocab.json + merges.txt, or sentencepiece.model) are copied to SAVE/tokenizer/ and recorded. A model
mpzero's GPT cannot compute (another model type, activation, MLP width, attention scaling) or a directory that
is not a GPT-2, Llama, Mixtral or Qwen3-MoE model is one `error:` line and exit code 2; --save appears complete
or not at all. A mixture of experts' files hold one tensor per expert (the hub's names; transformers 5 converts
them on load and save, mpzero.inference.hf_moe), and its checkpoint then trains and generates at any TP x EP.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from mpzero.checkpointing.checkpoint import error_reason
from mpzero.checkpointing.imported import check_import_destination, write_imported
from mpzero.checkpointing.verify import single_process
from mpzero.cli import INPUT_ERRORS, Parser, Path, exit_code
from mpzero.cli.flag_ranges import check_in_ranges
from mpzero.data import build_tokenizer, tokenizer_identity
from mpzero.errors import ConfigError
from mpzero.inference.hf import adapter_for_hf, tying_as_loaded


def import_hf(input_dir: str, save: str) -> str:
    """Writes the checkpoint under `save`; returns the lines to print. Everything is checked before writing."""
    source = f"--input {input_dir}"
    config_path = os.path.join(input_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ConfigError(f"{source} is not a Hugging Face model directory (no config.json)")
    try:
        with open(config_path, encoding="utf-8") as f:
            hf = json.load(f)
    except ValueError:
        raise ConfigError(f"{source}: config.json is not valid JSON") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{source}: config.json is not a JSON object")
    adapter = adapter_for_hf(hf, source)  # by model_type: gpt2 or llama
    check_in_ranges(hf, adapter.hf_flags, source)  # each number within the range of the flag it becomes
    config = adapter.config_from_hf(hf, source)
    state = _read_state(input_dir, source)
    config, tying = tying_as_loaded(config, state, adapter)
    weights = adapter.from_hf_state_dict(state, config, source)
    tokenizer_files, tokenizer_flags, note = _tokenizer(input_dir, config.vocab_size, save)
    record = tokenizer_flags.pop("tokenizer", None)  # its files' sha256, recorded as a trained checkpoint's are
    note += tying
    check_import_destination(save, {"--input": input_dir})
    write_imported(save, weights, {**adapter.model_flags(config), **tokenizer_flags},
                   {name: os.path.join(input_dir, name) for name in tokenizer_files}, record)
    tokenizer_args = [f"--{k.replace('_', '-')} {v}" for k, v in tokenizer_flags.items() if k != "vocab_size"]
    size = sum(t.numel() for t in weights.values())
    return (f"imported {input_dir} ({size:,} parameters) to {save} (iteration 0, weights only){note}\n"
            f"train from it: pretrain_gpt.py --load {save} --finetune {' '.join(adapter.command_line(config))} "
            f"{' '.join(tokenizer_args)} --seq-length N ...")


def _read_state(input_dir: str, source: str) -> dict[str, torch.Tensor]:
    """The state dict of model.safetensors, a sharded model.safetensors.index.json, or pytorch_model.bin."""
    single = os.path.join(input_dir, "model.safetensors")
    index = os.path.join(input_dir, "model.safetensors.index.json")
    binary = os.path.join(input_dir, "pytorch_model.bin")
    try:
        if os.path.isfile(single) or os.path.isfile(index):
            try:
                from safetensors.torch import load_file
            except ImportError:
                raise ConfigError("tools/import_hf.py needs safetensors: pip install -e '.[hf]'") from None
            if os.path.isfile(single):
                return load_file(single)
            return {k: t for path in _index_shards(input_dir, index, source) for k, t in load_file(path).items()}
        if os.path.isfile(binary):
            return torch.load(binary, map_location="cpu", weights_only=True)
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 - a damaged file raises anything
        raise ConfigError(f"{source}: its weights are unreadable ({error_reason(error)})") from None
    raise ConfigError(f"{source} has no weights (model.safetensors, model.safetensors.index.json or "
                      f"pytorch_model.bin): save the model with save_pretrained")


def _index_shards(input_dir: str, index: str, source: str) -> list[str]:
    """The shard files a sharded index's weight_map names, each a plain file name inside `input_dir`: an
    absolute path, a `..`, or a symbolic link leading out of it is refused (the index could come from anyone)."""
    with open(index, encoding="utf-8") as f:
        index_json = json.load(f)
    weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"{source}: model.safetensors.index.json has no weight_map")
    root = os.path.realpath(input_dir)
    paths = []
    for shard in sorted(set(weight_map.values()), key=str):
        real = os.path.realpath(os.path.join(root, shard)) if isinstance(shard, str) and shard else None
        if (real is None or os.path.isabs(shard) or ".." in shard.replace("\\", "/").split("/")
                or os.path.commonpath([root, real]) != root):
            raise ConfigError(f"{source}: model.safetensors.index.json names the shard {shard!r}, which is not a "
                              f"file inside {input_dir}: refused")
        paths.append(real)
    return paths


def _tokenizer(input_dir: str, vocab_size: int, save: str) -> tuple[list[str], dict, str]:
    """(files to copy, tokenizer flags for meta.json, a note): GPT-2 BPE, SentencePiece, or none."""
    where = os.path.join(os.path.abspath(save), "tokenizer")
    if all(os.path.isfile(os.path.join(input_dir, n)) for n in ("vocab.json", "merges.txt")):
        files, flags = ["vocab.json", "merges.txt"], {"tokenizer_type": "GPT2BPETokenizer",
                                                      "vocab_file": os.path.join(where, "vocab.json"),
                                                      "merge_file": os.path.join(where, "merges.txt")}
        tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=os.path.join(input_dir, "vocab.json"),
                                    merge_file=os.path.join(input_dir, "merges.txt"))
    elif os.path.isfile(os.path.join(input_dir, "sentencepiece.model")):  # as tools/export_hf.py writes it
        files, flags = ["sentencepiece.model"], {"tokenizer_type": "GPTSentencePieceTokenizer",
                                                 "tokenizer_model": os.path.join(where, "sentencepiece.model")}
        tokenizer = build_tokenizer("GPTSentencePieceTokenizer", os.path.join(input_dir, "sentencepiece.model"))
    else:
        return [], {}, "; no tokenizer files (vocab.json + merges.txt): pass your own --tokenizer-* flags"
    if tokenizer.vocab_size != vocab_size:
        return [], {}, (f"; its tokenizer has {tokenizer.vocab_size} tokens and the model {vocab_size}, so it is "
                        f"not recorded: pass a tokenizer of {vocab_size} tokens")
    return files, {**flags, "tokenizer": tokenizer_identity(tokenizer)}, ""


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--input", type=Path("dir"), required=True,
                   help="a local Hugging Face GPT-2, Llama, Mixtral or Qwen3-MoE directory (save_pretrained)")
    p.add_argument("--save", type=Path("dir", exists=False, writable=True), required=True,
                   help="a new directory for the mpzero checkpoint")
    args = p.parse_args(argv)
    with single_process():  # no process group here: DCP's warning about that says nothing
        return exit_code(lambda: print(import_hf(args.input, args.save), flush=True), INPUT_ERRORS)


if __name__ == "__main__":
    sys.exit(main())
