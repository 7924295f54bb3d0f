"""Export an mpzero checkpoint (any TP x DP x ZeRO x EP layout) as a Hugging Face GPT-2, Llama or MoE directory.

    python tools/export_hf.py --load checkpoints/quickstart --output hf/kjv
    python -c "from transformers import GPT2LMHeadModel; GPT2LMHeadModel.from_pretrained('hf/kjv')"

A LLaMA-family checkpoint (RMSNorm, SwiGLU, RoPE; mpzero.inference.hf_llama) becomes a LlamaForCausalLM directory
(config.json with num_key_value_heads, rope_theta, rms_norm_eps, tie_word_embeddings, intermediate_size); one with
mixture-of-experts layers a MixtralForCausalLM directory (mpzero.inference.hf_mixtral), or with --qk-layernorm too a
Qwen3MoeForCausalLM one (hf_qwen3_moe), the experts under the per-expert names of the hub's files
(`block_sparse_moe.experts.E.w1/w2/w3`, `mlp.experts.E.gate_proj/up_proj/down_proj`).

Writes config.json (every architecture choice that changes the logits: activation, LayerNorm epsilon, tied or
untied output weights, the real vocabulary without its padding), model.safetensors (or, past --max-shard-size,
model-0000i-of-0000N.safetensors and model.safetensors.index.json, as save_pretrained shards), generation_config.json,
the tokenizer (GPT-2 BPE: vocab.json, merges.txt and tokenizer_config.json, loadable with AutoTokenizer;
HuggingFaceTokenizer: tokenizer.json and tokenizer_config.json, the same;
SentencePiece: sentencepiece.model) and README.md saying where it came from and how to load the tokenizer.
The weights are read with tools/checkpoint_util.py's reader (every chunk checksummed). The directory appears
complete or not at all: it is written beside --output and renamed into place. Needs `pip install mpzero[hf]`
(safetensors). A bad input is one `error:` line and exit code 2.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch

from mpzero.checkpointing.checkpoint import previous_advice, read_meta_file
from mpzero.checkpointing.outputs import (check_apart_from_checkpoints, check_replaceable,
                                          foreign_files)
from mpzero.checkpointing.verify import resolve_iteration, single_process
from mpzero.cli import INPUT_ERRORS, ITERATION, Parser, Path, Size, add_tokenizer_flags, exit_code
from mpzero.errors import ConfigError
from mpzero.files import (check_parents_creatable, copy_atomically, directory_beside, make_parents,
                          replace_output_directory, write_atomically)
from mpzero.inference import check_gpt_weights, gpt_config_from_meta, run_tokenizer
from mpzero.inference.hf import ADAPTERS, adapter_for_config
from mpzero.inference.hf_shards import INDEX, SHARD_NAME, index, shards
from mpzero.checkpointing.consolidated import read_consolidated

TOKENIZER_FLAGS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")
README_TITLES = {adapter.title for adapter in ADAPTERS.values()}
# every file an export writes (the tokenizer's depend on the run's): --overwrite replaces only a directory of these
EXPORTED_FILES = frozenset({"config.json", "model.safetensors", "generation_config.json", "README.md", "vocab.json",
                            "merges.txt", "special_tokens_map.json", "tokenizer_config.json", "sentencepiece.model",
                            "tokenizer.json", INDEX})
DTYPES = {"fp32": (torch.float32, "float32"), "bf16": (torch.bfloat16, "bfloat16"), "fp16": (torch.float16, "float16")}


def export(load: str, iteration: int | None, output: str, dtype: str = "fp32", overwrite: bool = False,
           tokenizer_overrides: dict | None = None, max_shard_size: float = 5e9) -> str:
    """Writes the HF directory `output`; returns the line to print. Everything is checked before writing."""
    serialize = _safetensors_writer()
    shard_bytes = int(max_shard_size)
    _check_output(output, overwrite, load)
    directory, iteration = resolve_iteration(load, iteration)
    meta = read_meta_file(directory, previous_advice(load, iteration))
    config = gpt_config_from_meta(meta, directory)
    adapter = adapter_for_config(config)
    flags = meta.get("config") or {}
    run_tok = run_tokenizer(flags, load, tokenizer_overrides)
    tokenizer = run_tok.build(config.vocab_size, meta, directory)
    eod = tokenizer.eod if run_tok.tokenizer_type else None
    weights = read_consolidated(load, iteration)["model"]
    check_gpt_weights(weights, config, directory)
    torch_dtype, dtype_name = DTYPES[dtype]
    state = adapter.to_hf_state_dict(weights, config, torch_dtype)

    make_parents(output)
    tmp = directory_beside(output)  # a fresh name: never a directory of the user's
    try:
        # the bytes in memory, then through mpzero's writer (safetensors' own save_file opens the name itself)
        files = shards(state, shard_bytes)
        for name, tensors in files:
            write_atomically(os.path.join(tmp, name), serialize(tensors, metadata={"format": "pt"}))
        if index(files) is not None:
            _write_json(tmp, INDEX, index(files))
        _write_json(tmp, "config.json", adapter.hf_config(config, flags, eod, dtype_name))
        _write_json(tmp, "generation_config.json", {"bos_token_id": eod, "eos_token_id": eod})
        note = _write_tokenizer(tmp, output, run_tok, tokenizer, config.max_position_embeddings)
        write_atomically(os.path.join(tmp, "README.md"), _readme(directory, iteration, meta, config, note, output,
                                                                 adapter))
        replace_output_directory(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(t.numel() for t in state.values())
    return (f"exported {directory} (iteration {iteration}, {size:,} parameters, {dtype_name}) to {output}: "
            f"{adapter.architecture}.from_pretrained({output!r})")


def _safetensors_writer():
    try:
        from safetensors.torch import save
    except ImportError:
        raise ConfigError("tools/export_hf.py needs safetensors: pip install -e '.[hf]'") from None
    return save


def _check_output(output: str, overwrite: bool, load: str) -> None:
    """--output is apart from every checkpoint and from --load; an existing one is replaced only with
    --overwrite, and only when it is an earlier export (the files this tool writes, its README)."""
    check_apart_from_checkpoints(output, "--output", {"--load": load})
    check_replaceable(output, "--output", "tools/export_hf.py", overwrite, _not_an_export)
    check_parents_creatable(output, "--output")


def _not_an_export(output: str) -> str | None:
    """What shows that `output` is not a directory this tool wrote, or None."""
    shard_files = {name for name in os.listdir(output) if SHARD_NAME.match(name)} if os.path.isdir(output) else set()
    names = EXPORTED_FILES | shard_files
    foreign = foreign_files(output, frozenset(names))
    if foreign:
        return foreign
    try:
        with open(os.path.join(output, "README.md"), encoding="utf-8") as f:
            first = f.readline().rstrip("\n")
    except (OSError, ValueError):
        first = None
    return None if first in README_TITLES else "its README.md is not an mpzero export's"


def _write_json(directory: str, name: str, content: dict) -> None:
    write_atomically(os.path.join(directory, name), json.dumps(content, indent=2, sort_keys=True) + "\n")


def _write_tokenizer(directory: str, final: str, run_tok, tokenizer, positions: int) -> str:
    """Copy the run's tokenizer files; returns the README's paragraph on loading the tokenizer."""
    kind = run_tok.tokenizer_type
    if kind == "GPT2BPETokenizer":
        copy_atomically(run_tok.vocab_file, os.path.join(directory, "vocab.json"))
        copy_atomically(run_tok.merge_file, os.path.join(directory, "merges.txt"))
        special = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
        _write_json(directory, "special_tokens_map.json", special)
        _write_json(directory, "tokenizer_config.json", {**special, "tokenizer_class": "GPT2Tokenizer",
                                                          "add_prefix_space": False, "model_max_length": positions})
        return ("The run's GPT-2 byte-level BPE (vocab.json, merges.txt): `AutoTokenizer.from_pretrained(dir)` "
                "encodes text as mpzero's GPT2BPETokenizer does. End of document: `<|endoftext|>` "
                f"(id {tokenizer.eod}).")
    if kind == "HuggingFaceTokenizer":
        copy_atomically(tokenizer.files[0], os.path.join(directory, "tokenizer.json"))
        special = {"eos_token": tokenizer.eod_token}
        _write_json(directory, "special_tokens_map.json", special)
        _write_json(directory, "tokenizer_config.json", {**special, "tokenizer_class": "PreTrainedTokenizerFast",
                                                          "model_max_length": positions})
        return ("The run's Hugging Face tokenizer (`tokenizer.json`): `AutoTokenizer.from_pretrained(dir)` loads it; "
                "`tok(text, add_special_tokens=False)` encodes as mpzero's HuggingFaceTokenizer does (mpzero adds no "
                f"BOS). End of document: `{tokenizer.eod_token}` (id {tokenizer.eod}).")
    if kind == "GPTSentencePieceTokenizer":
        copy_atomically(run_tok.tokenizer_model, os.path.join(directory, "sentencepiece.model"))
        path = os.path.join(final, "sentencepiece.model")
        return ("The run's SentencePiece model is `sentencepiece.model`; transformers has no GPT-2 tokenizer for it. "
                "Load it with `sentencepiece`:\n\n"
                "    import sentencepiece\n"
                f"    sp = sentencepiece.SentencePieceProcessor(model_file={path!r})\n"
                "    ids = sp.encode('In the beginning')   # no BOS/EOS added, as mpzero trains\n"
                "    text = sp.decode(ids)\n\n"
                f"End of document is the model's end-of-sentence id {tokenizer.eod} (`eos_token_id` in config.json), "
                "so `model.generate(torch.tensor([ids]))` stops there.")
    if kind == "NullTokenizer":
        return (f"The run used NullTokenizer: inputs are token ids, {tokenizer.eod} is end-of-document. "
                "No tokenizer files.")
    return "The run trained on --mock-data: there is no tokenizer; inputs are token ids."


def _readme(directory: str, iteration: int, meta: dict, config, note: str, output: str, adapter) -> str:
    layout = meta.get("layout", {})
    return (f"{adapter.title}\n\n"
            f"Checkpoint `{directory}`, iteration {iteration}, saved at TP {layout.get('tp')} x DP {layout.get('dp')} "
            f"(ZeRO stage {(meta.get('config') or {}).get('zero_stage')}); {config.num_layers} layers, hidden "
            f"{config.hidden_size}, {config.num_attention_heads} heads, vocabulary {config.vocab_size}, "
            f"{config.max_position_embeddings} positions, {adapter.describe(config)}, output weights "
            f"{'untied' if config.untie_embeddings_and_output_weights else 'tied'}.\n\n"
            f"    from transformers import {adapter.architecture}\n"
            f"    model = {adapter.architecture}.from_pretrained({output!r})\n\n"
            f"## Tokenizer\n\n{note}\n\n"
            f"Back to mpzero: `python tools/import_hf.py --input {output} --save CKPT`.\n")


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--load", type=Path("dir"), required=True, help="the --save directory of a run")
    p.add_argument("--iteration", type=ITERATION, default=None, help="default: the latest")
    p.add_argument("--output", type=Path("dir", exists=False, writable=True), required=True,
                   help="the Hugging Face model directory to write")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="of the stored weights (default fp32)")
    p.add_argument("--max-shard-size", type=Size(low=1.0, low_ok=True), default="5GB",
                   help="the largest safetensors file (as save_pretrained: 5GB, 500MB); larger models are sharded")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --output, if it is an earlier export (nothing else is ever replaced)")
    add_tokenizer_flags(p, "default: the run's (meta.json)")
    args = p.parse_args(argv)
    overrides = {name: getattr(args, name) for name in TOKENIZER_FLAGS}
    with single_process():  # no process group here: DCP's warning about that says nothing
        return exit_code(lambda: print(export(args.load, args.iteration, args.output, args.dtype, args.overwrite,
                                              overrides, args.max_shard_size), flush=True), INPUT_ERRORS)


if __name__ == "__main__":
    sys.exit(main())
