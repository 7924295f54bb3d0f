"""Generation tokens/s: mpzero with its KV cache, mpzero recomputing the whole prefix at every step, and
transformers' `generate` on the same weights exported as GPT-2 (GPT2LMHeadModel, its own KV cache), measured in
the same run on the same prompt, greedy, for the same number of new tokens (end-of-document ignored).

    python bench/bench_generate.py                                   # GPT-2 124M shape, random weights
    python bench/bench_generate.py --num-layers 4 --hidden-size 128 --num-attention-heads 4 --vocab-size 4000 \
        --max-position-embeddings 128 --prompt-length 16 --new-tokens 96     # the quickstart's model shape
    python bench/bench_generate.py --load checkpoints/quickstart --prompt-length 16 --new-tokens 96

Weights: random (GPTConfig's initialization) unless --load names a checkpoint. The methods must produce
the same tokens (checked and printed). World of one; --device cuda on a GPU (--dtype bf16 there if you like).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from mpzero.inference import (SamplingConfig, gpt_config_from_meta, generate, hf_config,
                              load_full_weights, to_hf_state_dict)
from mpzero.models import GPTConfig, GPTModel
from mpzero.parallel import init_parallel

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build(args, groups):
    """(mpzero model, its full weights by name)."""
    if args.load:
        from mpzero.checkpointing.consolidated import read_consolidated
        bundle = read_consolidated(args.load, None)
        config = gpt_config_from_meta(bundle["meta"], args.load)
        weights = bundle["model"]
    else:
        config = GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                           num_attention_heads=args.num_attention_heads, vocab_size=args.vocab_size,
                           max_position_embeddings=args.max_position_embeddings, hidden_dropout=0.0,
                           attention_dropout=0.0, openai_gelu=True)
        weights = None
    model = GPTModel(config, groups.tp)
    if weights is None:  # the model's own random initialization, vocabulary padding cropped as checkpoints store
        weights = {name: p.detach()[:config.vocab_size] if name in ("embedding.word_embeddings.weight",
                                                                     "output_layer.weight") else p.detach()
                   for name, p in model.named_parameters()}
    load_full_weights(model, weights)
    return model.to(args.device, DTYPES[args.dtype]).eval(), weights


def hf_model(model, weights, args):
    from transformers import GPT2Config, GPT2LMHeadModel
    config = model.config
    hf = GPT2LMHeadModel(GPT2Config(**{k: v for k, v in hf_config(config, {"hidden_dropout": 0.0,
                                                                           "attention_dropout": 0.0}, None).items()
                                       if k not in ("architectures", "model_type", "dtype")}))
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(weights, config), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied: wte's
    hf.generation_config.eos_token_id = None  # every method makes exactly --new-tokens
    return hf.to(args.device, DTYPES[args.dtype]).eval()


def timed(fn, repeats: int):
    """(best seconds of `repeats` runs after one warm-up, its result)."""
    result, best = fn(), float("inf")
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", default=None, help="a checkpoint (default: random weights of the shape below)")
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--hidden-size", type=int, default=768)
    p.add_argument("--num-attention-heads", type=int, default=12)
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--max-position-embeddings", type=int, default=1024)
    p.add_argument("--prompt-length", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    groups = init_parallel(1, backend="gloo")
    model, weights = build(args, groups)
    try:
        hf = hf_model(model, weights, args)
    except ImportError:
        hf = None
        print("transformers is not installed: its row is left out (pip install -e '.[hf]')")
    config = model.config
    prompts = torch.randint(0, config.vocab_size, (args.batch_size, args.prompt_length),
                            generator=torch.Generator().manual_seed(0))
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, greedy=True, stop_at_eod=False)
    methods = {
        "mpzero, KV cache": lambda: generate(model, prompts.tolist(), sampling, eod=0),
        "mpzero, whole prefix recomputed": lambda: generate(model, prompts.tolist(), sampling, eod=0,
                                                            use_cache=False),
    }
    if hf is not None:
        methods["transformers generate (exported)"] = lambda: hf.generate(
            prompts.to(args.device), do_sample=False, max_new_tokens=args.new_tokens, min_new_tokens=0,
            pad_token_id=0)[:, args.prompt_length:].tolist()
    print(f"model: {config.num_layers} layers, hidden {config.hidden_size}, {config.num_attention_heads} heads, "
          f"vocabulary {config.vocab_size}, {sum(t.numel() for t in weights.values()):,} parameters; "
          f"{args.dtype} on {args.device} ({args.threads} threads), torch {torch.__version__}; batch "
          f"{args.batch_size}, prompt {args.prompt_length} tokens, {args.new_tokens} new tokens, best of "
          f"{args.repeats}", flush=True)
    print("| method | tokens/s | ms/token | / KV cache |\n|---|---:|---:|---:|")
    results, first = {}, None
    with torch.no_grad():
        for name, fn in methods.items():
            seconds, results[name] = timed(fn, args.repeats)
            rate = args.batch_size * args.new_tokens / seconds
            first = first or rate
            print(f"| {name} | {rate:,.1f} | {1000 * seconds / args.new_tokens:.2f} | {rate / first:.2f} |",
                  flush=True)
    same = len({str(r) for r in results.values()}) == 1
    print(f"same tokens from every method: {'yes' if same else 'NO'}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
