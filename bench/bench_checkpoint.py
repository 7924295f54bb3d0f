"""Save and load time of a checkpoint with and without checksums (issue 16, item 6).

    python -m bench.bench_checkpoint [--models quickstart 100m] [--repeats 3] [--dir /tmp]

One process, a world of one (gloo), fp32, ZeRO stage 1: the training state pretrain_gpt builds (model,
ZeroOptimizer, RNG), saved with `save_checkpoint(..., checksums=True/False)` and loaded with
`load_checkpoint` (verifying every stored chunk, or a checkpoint without checksums: nothing verified).
Save and load alternate between the two variants, best of --repeats each; the files stay in the page cache
(what a save that is immediately reloaded, or a load of a recent save, sees; a cold read from disk is slower
and makes the checksum's share smaller). Also timed: the checksum alone over every stored byte (CRC-32C and,
for comparison, zlib's CRC-32), and `tools/checkpoint_util.py verify`'s full check. Checkpoints are written
under --dir and deleted afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from mpzero.cli.arguments import parse_args, run_config
from mpzero.checkpointing import load_checkpoint, save_checkpoint
from mpzero.checkpointing.checksums import ALGORITHM, checksum
from mpzero.checkpointing.verify import verify_checkpoint
from mpzero.parallel import init_parallel
from mpzero.training import build_training_state
from pretrain_gpt import gpt_provider

MODELS = {
    "quickstart": ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
                   "--vocab-size", "4000"],
    "100m": ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "1024",
             "--vocab-size", "32000"],
}
COMMON = ["--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-4", "--mock-data",
          "--zero-stage", "1", "--eval-iters", "0"]


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench(name: str, repeats: int, where: str, groups) -> dict:
    argv = MODELS[name] + COMMON
    run = run_config(parse_args(argv), 1)
    state = build_training_state(run, gpt_provider, groups)
    model, optimizer, rng = state.model.module, state.optimizer, state.rng
    params = sum(p.numel() for p in model.parameters())
    roots = {True: os.path.join(where, f"{name}-crc"), False: os.path.join(where, f"{name}-plain")}
    meta = {"consumed_samples": 0, "skipped_iterations": 0}
    times = {}
    quiet = contextlib.redirect_stdout(io.StringIO())
    for variant in (True, False) * repeats:  # interleaved: both see the same machine state
        start = time.perf_counter()
        save_checkpoint(roots[variant], 1, model, optimizer, rng, groups, meta, checksums=variant)
        times.setdefault(("save", variant), []).append(time.perf_counter() - start)
    for variant in (True, False) * repeats:
        start = time.perf_counter()
        with quiet:
            load_checkpoint(roots[variant], model, optimizer, rng, groups)
        times.setdefault(("load", variant), []).append(time.perf_counter() - start)
    stored = sum(os.path.getsize(os.path.join(roots[True], "iter_0000001", f))
                 for f in os.listdir(os.path.join(roots[True], "iter_0000001")) if f.endswith(".distcp"))
    pieces = [t for piece in optimizer.owned_pieces() for t in piece.tensors.values()]
    crc_alone = best(lambda: [checksum(t) for t in pieces], repeats)
    zlib_alone = best(lambda: [checksum(t, "crc32") for t in pieces], repeats)
    verify = best(lambda: verify_checkpoint(roots[True]), repeats)
    for root in roots.values():
        shutil.rmtree(root)
    out = {"params": params, "bytes": stored, "crc_alone": crc_alone, "zlib_alone": zlib_alone, "verify": verify,
           **{f"{kind}_{'crc' if v else 'plain'}": min(ts) for (kind, v), ts in times.items()}}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir())
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    store_dir = tempfile.mkdtemp(prefix="bench-ckpt-store-", dir=args.dir)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, "store"), 1), rank=0, world_size=1,
                            timeout=timedelta(minutes=10))
    groups = init_parallel(1)
    work = tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir)
    try:
        print(f"checksum: {ALGORITHM}; best of {args.repeats}; page cache warm")
        print("| model | params | stored | save plain | save + checksums | ratio | load plain | load + verify | "
              "ratio | checksum alone | zlib crc32 alone | verify (tool) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for name in args.models:
            r = bench(name, args.repeats, work, groups)
            print(f"| {name} | {r['params'] / 1e6:.1f} M | {r['bytes'] / 2**20:.0f} MiB | {r['save_plain']:.3f} s | "
                  f"{r['save_crc']:.3f} s | {r['save_crc'] / r['save_plain']:.2f}x | {r['load_plain']:.3f} s | "
                  f"{r['load_crc']:.3f} s | {r['load_crc'] / r['load_plain']:.2f}x | {r['crc_alone']:.3f} s "
                  f"({r['bytes'] / 2**30 / r['crc_alone']:.1f} GiB/s) | {r['zlib_alone']:.3f} s "
                  f"({r['bytes'] / 2**30 / r['zlib_alone']:.1f} GiB/s) | {r['verify']:.3f} s |", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(store_dir, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
