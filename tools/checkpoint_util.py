"""Convert an mpzero checkpoint to one consolidated file of full fp32 weights, and back.

    python tools/checkpoint_util.py to-consolidated --load CKPT [--iteration N] --output weights.pt
    python tools/checkpoint_util.py from-consolidated --input weights.pt --save CKPT2

The consolidated file is `torch.save({"model": {name: full tensor}, "meta": {...}})`: global shapes,
vocabulary padding removed, loadable anywhere with plain `torch.load`. A checkpoint made from it holds
weights only (iteration 0): train from it with `--load CKPT2 --finetune` (or `--no-load-optim`) at any
TP x DP x ZeRO layout. Runs in one process, no torchrun needed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mpzero.checkpointing import (FORMAT, LATEST, checkpoint_dir, checkpoint_key, latest_iteration,  # noqa: E402
                                  parse_checkpoint_key)
from mpzero.checkpointing.format import MASTER  # noqa: E402
from mpzero.cli import run_or_exit  # noqa: E402
from mpzero.errors import ConfigError  # noqa: E402
from mpzero.files import replace_directory, write_atomically  # noqa: E402


def to_consolidated(load: str, iteration: int | None, output: str) -> None:
    iteration = latest_iteration(load) if iteration is None else iteration
    directory = checkpoint_dir(load, iteration) if iteration is not None else None
    if directory is None or not os.path.isfile(os.path.join(directory, "meta.json")):
        where = f" at iteration {iteration}" if iteration is not None else ""
        raise ConfigError(f"no mpzero checkpoint under {load}{where}")
    with open(os.path.join(directory, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    names = {}  # checkpoint key: parameter name, for the fp32 weights
    for key in meta["shapes"]:
        state, name = parse_checkpoint_key(key)
        if state == MASTER:
            names[key] = name
    model = {key: torch.zeros(meta["shapes"][key]) for key in names}
    dcp.load(model, checkpoint_id=directory)  # no process group: read whole tensors in this process
    bundle = {"model": {names[key]: t for key, t in model.items()}, "meta": meta}
    write_atomically(output, lambda f: torch.save(bundle, f))


def from_consolidated(input_path: str, save: str) -> None:
    if not os.path.isfile(input_path):
        raise ConfigError(f"--input {input_path}: no such file")
    bundle = torch.load(input_path, weights_only=True)
    if not isinstance(bundle, dict) or not isinstance(bundle.get("model"), dict):
        raise ConfigError(f"--input {input_path} is not a consolidated checkpoint (expected a dict with 'model')")
    tensors = {checkpoint_key(MASTER, name): t.float() for name, t in bundle["model"].items()}
    directory = checkpoint_dir(save, 0)
    if os.path.exists(directory):
        raise ConfigError(f"--save {save} already holds {directory}: choose an empty directory")
    tmp = directory + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier conversion
    os.makedirs(tmp)
    dcp.save(tensors, checkpoint_id=tmp)
    meta = {"format": FORMAT, "iteration": 0, "consumed_samples": 0, "skipped_iterations": 0,
            "config": bundle.get("meta", {}).get("config", {}), "layout": {"world": 1, "tp": 1, "dp": 1},
            "shapes": {key: list(t.shape) for key, t in tensors.items()}}
    write_atomically(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1, sort_keys=True))
    replace_directory(tmp, directory)
    write_atomically(os.path.join(save, LATEST), "0")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    out = sub.add_parser("to-consolidated")
    out.add_argument("--load", required=True)
    out.add_argument("--iteration", type=int, default=None, help="default: the latest")
    out.add_argument("--output", required=True)
    back = sub.add_parser("from-consolidated")
    back.add_argument("--input", required=True)
    back.add_argument("--save", required=True)
    args = p.parse_args(argv)
    if args.command == "to-consolidated":
        run_or_exit(lambda: to_consolidated(args.load, args.iteration, args.output))
    else:
        run_or_exit(lambda: from_consolidated(args.input, args.save))


if __name__ == "__main__":
    main()
