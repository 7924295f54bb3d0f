"""Generate text from an mpzero checkpoint at any TP (x EP) size, with a KV cache.

    python tools/generate.py --load checkpoints/quickstart --prompt "In the beginning" --max-new-tokens 40
    torchrun --nproc_per_node 2 tools/generate.py --load CKPT --tensor-model-parallel-size 2 \
        --prompt-file prompts.txt --greedy --output-format jsonl
    echo "And God said" | python tools/generate.py --load CKPT --temperature 0.8 --top-k 40 --top-p 0.95 --seed 7

Prompts: each --prompt, else one per line of --prompt-file, else one per line of stdin; an empty prompt starts
from end-of-document (unconditional samples). Prompts are encoded with the run's tokenizer (meta.json; the
--tokenizer-* flags point elsewhere) and run in batches of --batch-size. Sampling: --greedy (argmax, as
transformers' generate(do_sample=False)), else --temperature, --top-k, --top-p and --seed; a continuation
ends at --max-new-tokens, at end-of-document (unless --ignore-eod) or at the model's last position.
Output (rank 0): each prompt followed by its continuation and a blank line, or with --output-format jsonl one
{"prompt", "text", "tokens", "stop"} line per prompt (stop: end_of_document, max_new_tokens or
max_position_embeddings); --output FILE writes it there, complete or not at all.
Under torchrun the world is the TP group: its ranks each hold their heads and vocabulary shard and draw the
same tokens. A mixture of experts also splits its experts over --expert-model-parallel-size ranks (each expert
over --expert-tensor-parallel-size, default the TP size), folded over TP x DP as in training: the world is then TP
x DP with DP = EP x expert-TP / gcd(EP x expert-TP, TP) (EP at the default expert-TP), every rank generating the
same tokens. Everything (checkpoint, tokenizer, prompt lengths) is checked before any output: a problem is one
`error:` line and exit code 2.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys

import torch
import torch.distributed as dist

from mpzero.checkpointing.checkpoint import previous_advice, read_meta_file
from mpzero.checkpointing.outputs import check_apart_from_checkpoints
from mpzero.checkpointing.verify import resolve_iteration, single_process
from mpzero.cli import ITERATION, SEED, Number, Parser, Path, Text, add_tokenizer_flags, print_error
from mpzero.errors import ConfigError
from mpzero.files import check_parents_creatable, make_parents, write_atomically
from mpzero.launcher_env import launcher_env
from mpzero.inference import (SamplingConfig, check_gpt_weights, generate, gpt_config_from_meta,
                              load_full_weights, run_tokenizer)
from mpzero.models import family_of
from mpzero.moe import check_expert_grid, restore_expert_biases
from mpzero.parallel import init_parallel
from mpzero.checkpointing.consolidated import read_consolidated

TOKENIZER_FLAGS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--load", type=Path("dir"), required=True,
                   help="the --save directory of a run (or of tools/import_hf.py)")
    p.add_argument("--iteration", type=ITERATION, default=None, help="default: the latest")
    p.add_argument("--prompt", type=Text(empty_ok=True), action="append", default=None,
                   help="a prompt (repeat for a batch; empty: from end-of-document)")
    p.add_argument("--prompt-file", type=Path("file", text=True), default=None,
                   help="one prompt per line (default: stdin)")
    p.add_argument("--max-new-tokens", type=Number(int, low=1), default=64)
    p.add_argument("--greedy", action="store_true", help="argmax instead of sampling")
    p.add_argument("--temperature", type=Number(float, low=0.0, low_ok=False), default=1.0)
    p.add_argument("--top-k", type=Number(int, low=0), default=0, help="0: off")
    p.add_argument("--top-p", type=Number(float, low=0.0, low_ok=False, high=1.0, high_ok=True), default=1.0,
                   help="1: off")
    p.add_argument("--seed", type=SEED, default=1234)
    p.add_argument("--ignore-eod", action="store_true", help="go on past end-of-document")
    p.add_argument("--batch-size", type=Number(int, low=1), default=8, help="prompts generated together")
    p.add_argument("--tensor-model-parallel-size", type=Number(int, low=1), default=None,
                   help="default: the world size / --expert-model-parallel-size")
    p.add_argument("--expert-model-parallel-size", type=Number(int, low=1), default=1,
                   help="ranks a mixture of experts' experts are split over")
    p.add_argument("--expert-tensor-parallel-size", type=Number(int, low=1), default=None,
                   help="ranks each expert is split over (default: the TP size)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--no-kv-cache", action="store_true", help="recompute the whole prefix at every step")
    p.add_argument("--output-format", choices=("text", "jsonl"), default="text")
    p.add_argument("--output", type=Path("file", exists=False, writable=True), default=None,
                   help="write here instead of stdout")
    add_tokenizer_flags(p, "default: the run's (meta.json)")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    """The whole command; returns [{"prompt", "text", "tokens", "stop"}] (every rank) for tests and notebooks."""
    args = build_parser().parse_args(argv)
    owns_world = not dist.is_initialized()  # else the caller (a test) owns the process group
    try:  # each process checks its own launcher variables and says what is wrong with them
        env = launcher_env()
    except ConfigError as error:
        print_error(error)
        raise SystemExit(2) from None
    world_size = dist.get_world_size() if dist.is_initialized() else env.world_size
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    tp_size = args.tensor_model_parallel_size or max(world_size // ep, 1)
    try:
        groups = _groups(tp_size, ep, etp, world_size)
        with single_process():
            prepared, error = groups.world.run_agreed(lambda: _prepare(args, groups.ep.size, groups.expert_tp.size),
                                                      (ConfigError, OSError))
        if error:
            _fail(error)
        config, (weights, biases, directory), tokenizer, prompts = prepared
        model = family_of(config).build(config, groups.tp, device=groups.device, ep=groups.ep,
                                        expert_tp=groups.expert_tp)
        load_full_weights(model, weights)
        restore_expert_biases(model, biases, directory)  # aux-loss-free balancing steers the choice: the trained one
        model.to(DTYPES[args.dtype]).eval()
        del weights
        results = _generate_all(model, tokenizer, prompts, _sampling(args), not args.no_kv_cache, args.batch_size)
        if groups.world.rank == 0:
            _write(results, args)
        return results
    finally:
        if owns_world and dist.is_initialized():
            dist.destroy_process_group()


def _groups(tp: int, ep: int, etp: int | None, world_size: int):
    """The TP group times the fewest data-parallel ranks that fold the EP x expert-TP grid over TP x DP (every
    rank generates the same tokens); a world of another size, or an expert-TP other than 1 or TP, is one line."""
    experts = ep * (etp or tp)
    needed = tp * (experts // math.gcd(experts, tp))
    if needed != world_size:
        what = f"--tensor-model-parallel-size {tp}" + (
            "" if needed == tp else f" x {needed // tp} data-parallel ranks of the expert grid "
                                    f"(--expert-model-parallel-size {ep})")
        _fail(f"{what} must equal the number of processes {world_size}: generation runs one TP group (times the "
              f"ranks an expert grid folds over)")
    if etp not in (None, 1, tp):
        _fail(f"--expert-tensor-parallel-size {etp} must be 1 or the TP size {tp}: the experts are split over the TP "
              f"group itself or not at all")
    return init_parallel(tp, ep_size=ep, etp_size=etp)


def _fail(message: str) -> None:
    rank = dist.get_rank() if dist.is_initialized() else launcher_env().rank
    if rank == 0:
        print_error(message)
    raise SystemExit(2)


def _sampling(args) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=args.max_new_tokens, greedy=args.greedy, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_at_eod=not args.ignore_eod)


def _prepare(args, ep_size: int, etp_size: int):
    """(model config, (full weights, the routers' expert biases, the checkpoint), tokenizer, [(prompt text, ids)]),
    every input checked."""
    _sampling(args).validate()
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.output:
        if os.path.isdir(args.output):
            raise ConfigError(f"--output {args.output} is a directory: name the file to write")
        check_parents_creatable(args.output, "--output")
        check_apart_from_checkpoints(args.output, "--output", {"--load": args.load})
    directory, iteration = resolve_iteration(args.load, args.iteration)
    meta = read_meta_file(directory, previous_advice(args.load, iteration))
    config = gpt_config_from_meta(meta, directory)
    check_expert_grid(config, ep_size, etp_size)
    overrides = {name: getattr(args, name) for name in TOKENIZER_FLAGS}
    tokenizer = run_tokenizer(meta.get("config") or {}, args.load, overrides).build(config.vocab_size, meta,
                                                                                     directory)
    prompts = []
    for number, text in enumerate(_read_prompts(args), start=1):
        try:
            ids = tokenizer.tokenize(text) if text else [tokenizer.eod]
        except ValueError as error:  # NullTokenizer: not a list of ids
            raise ConfigError(f"prompt {number} is not token ids for this run's tokenizer ({error})") from None
        if not ids:
            raise ConfigError(f"prompt {number} ({text!r}) encodes to no tokens with this run's tokenizer: give it "
                              f"some text, or an empty prompt for an unconditional sample")
        if len(ids) >= config.max_position_embeddings:
            raise ConfigError(f"prompt {number} is {len(ids)} tokens, and the model sees at most "
                              f"{config.max_position_embeddings} positions (--max-position-embeddings): no room to "
                              f"generate; shorten it")
        prompts.append((text, ids))
    weights = read_consolidated(args.load, iteration)["model"]
    check_gpt_weights(weights, config, directory)
    biases = meta.get("moe_expert_bias") or {}
    if config.moe_router_enable_expert_bias and not biases:
        raise ConfigError(f"checkpoint {directory} holds no expert bias (--moe-router-enable-expert-bias): its "
                          f"routing cannot be reproduced")
    return config, (weights, biases, directory), tokenizer, prompts


def _read_prompts(args) -> list[str]:
    if args.prompt is not None:
        prompts = args.prompt
    elif args.prompt_file is not None:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompts = f.read().splitlines()
    else:
        prompts = sys.stdin.read().splitlines()
    if not prompts:
        raise ConfigError("no prompts: pass --prompt TEXT, --prompt-file FILE or lines on stdin")
    return prompts


def _generate_all(model, tokenizer, prompts, sampling: SamplingConfig, use_cache: bool, batch_size: int):
    results = []
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first:first + batch_size]
        new = generate(model, [ids for _, ids in batch], sampling, tokenizer.eod, use_cache=use_cache)
        for (text, ids), tokens in zip(batch, new):
            at_eod = sampling.stop_at_eod and bool(tokens) and tokens[-1] == tokenizer.eod
            shown = tokens[:-1] if at_eod else tokens
            stop = ("end_of_document" if at_eod else "max_new_tokens" if len(tokens) == sampling.max_new_tokens
                    else "max_position_embeddings")
            results.append({"prompt": text, "text": _continuation(tokenizer, ids if text else [], shown),
                            "tokens": tokens, "stop": stop})
    return results


def _continuation(tokenizer, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The text the new tokens add after the prompt (decoded together: a SentencePiece word's space is kept)."""
    whole, prefix = tokenizer.detokenize(prompt_ids + new_ids), tokenizer.detokenize(prompt_ids)
    return whole[len(prefix):] if whole.startswith(prefix) else tokenizer.detokenize(new_ids)


def _write(results: list[dict], args) -> None:
    out = io.StringIO()
    for r in results:
        if args.output_format == "jsonl":
            out.write(json.dumps(r, ensure_ascii=False) + "\n")
        else:
            out.write(f"{r['prompt']}{r['text']}\n\n")
    if args.output:
        make_parents(args.output)
        write_atomically(args.output, out.getvalue())
    else:
        sys.stdout.write(out.getvalue())
        sys.stdout.flush()


if __name__ == "__main__":
    main()
