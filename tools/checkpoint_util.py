"""Convert an mpzero checkpoint to one consolidated file of full fp32 weights, and back.

    python tools/checkpoint_util.py to-consolidated --load CKPT [--iteration N] --output weights.pt [--overwrite]
    python tools/checkpoint_util.py from-consolidated --input weights.pt --save CKPT2
    python tools/checkpoint_util.py verify --load CKPT [--iteration N]

The consolidated file is `torch.save({"model": {name: full tensor}, "meta": {...}})`: global shapes,
vocabulary padding removed, loadable anywhere with plain `torch.load`. A checkpoint made from it holds
weights only (iteration 0): train from it with `--load CKPT2 --finetune` (or `--no-load-optim`) at any
TP x DP x ZeRO layout. `verify` reads every file and stored chunk of a checkpoint and checks each chunk
against the checksum recorded when it was saved: `OK: ...` on stdout, or the first damaged file (and key) in
one `error:` line and exit code 2. Runs in one process, no torchrun needed.
"""

from __future__ import annotations

import os

import torch

from mpzero.checkpointing import checkpoint_dir
from mpzero.checkpointing.checkpoint import error_reason
from mpzero.checkpointing.consolidated import read_consolidated, save_weights_only
from mpzero.checkpointing.outputs import check_apart_from_checkpoints, check_replaceable
from mpzero.checkpointing.verify import single_process, verify_checkpoint
from mpzero.cli import INPUT_ERRORS, ITERATION, Parser, Path, run_or_exit
from mpzero.errors import ConfigError, excerpt
from mpzero.files import check_parents_creatable, make_parents, write_atomically


def to_consolidated(load: str, iteration: int | None, output: str, overwrite: bool = False) -> None:
    check_apart_from_checkpoints(output, "--output", {"--load": load})
    if os.path.isdir(output):
        raise ConfigError(f"--output {output} is a directory: name the file to write")
    check_replaceable(output, "--output", "checkpoint_util.py to-consolidated", overwrite, _not_consolidated)
    check_parents_creatable(output, "--output")
    bundle = read_consolidated(load, iteration)
    make_parents(output)
    write_atomically(output, lambda f: torch.save(bundle, f))


def _not_consolidated(path: str) -> str | None:
    """None when `path` is a file to-consolidated wrote ({"model": {name: tensor}, "meta": dict}), else why not."""
    try:
        bundle = torch.load(path, weights_only=True, mmap=True)  # mmap: the tensors are not read
    except Exception as error:  # noqa: BLE001 - a foreign file raises anything
        return f"not a consolidated checkpoint: {error_reason(error)}"
    if not (isinstance(bundle, dict) and set(bundle) == {"model", "meta"} and isinstance(bundle["model"], dict)):
        return "not a consolidated checkpoint"
    return None


def from_consolidated(input_path: str, save: str) -> None:
    if not os.path.isfile(input_path):
        raise ConfigError(f"--input {input_path}: no such file")
    _check_new_save(save)
    try:
        bundle = torch.load(input_path, weights_only=True)
    except Exception as error:  # noqa: BLE001 - a damaged or foreign file raises anything
        raise ConfigError(f"--input {input_path} is not a consolidated checkpoint ({error_reason(error)})") from None
    if not isinstance(bundle, dict) or not isinstance(bundle.get("model"), dict):
        raise ConfigError(f"--input {input_path} is not a consolidated checkpoint (expected a dict with 'model')")
    for name, value in bundle["model"].items():
        if not (isinstance(name, str) and isinstance(value, torch.Tensor) and value.is_floating_point()
                and value.layout == torch.strided):  # a sparse tensor's indices are not checked by torch.load
            what = f"a {value.dtype} {value.layout} tensor" if isinstance(value, torch.Tensor) else excerpt(value)
            raise ConfigError(f"--input {input_path} is not a consolidated checkpoint: its model[{excerpt(name)}] is "
                              f"{what}, not a tensor of weights")
    if not isinstance(bundle.get("meta", {}), dict):
        raise ConfigError(f"--input {input_path} is not a consolidated checkpoint: its meta is "
                          f"{excerpt(bundle['meta'])}, not a dict")
    save_weights_only(bundle, save)


def _check_new_save(save: str) -> None:
    """--save is a new or empty directory (a crashed conversion's partial iter_0000000.tmp aside), apart from
    every checkpoint."""
    directory = checkpoint_dir(save, 0)
    if os.path.exists(directory):
        raise ConfigError(f"--save {save} already holds {directory}: choose an empty directory")
    check_apart_from_checkpoints(save, "--save")
    if os.path.lexists(save) and not os.path.isdir(save):
        raise ConfigError(f"--save {save} is not a directory: choose an empty directory")
    others = sorted(set(os.listdir(save)) - {os.path.basename(directory) + ".tmp"}) if os.path.isdir(save) else []
    if others:  # only a crashed conversion's partial directory is ours to remove
        raise ConfigError(f"--save {save} already holds {others[0]}, which this tool did not write: choose an empty "
                          f"directory")


def main(argv: list[str] | None = None) -> None:
    p = Parser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    out = sub.add_parser("to-consolidated")
    out.add_argument("--load", type=Path("dir"), required=True)
    out.add_argument("--iteration", type=ITERATION, default=None, help="default: the latest")
    out.add_argument("--output", type=Path("file", exists=False, writable=True), required=True)
    out.add_argument("--overwrite", action="store_true",
                     help="replace an existing --output, if it is an earlier consolidated file (nothing else)")
    back = sub.add_parser("from-consolidated")
    back.add_argument("--input", type=Path("file"), required=True)
    back.add_argument("--save", type=Path("dir", exists=False, writable=True), required=True)
    check = sub.add_parser("verify", help="check every file and stored chunk of a checkpoint")
    check.add_argument("--load", type=Path("dir"), required=True)
    check.add_argument("--iteration", type=ITERATION, default=None, help="default: the latest")
    args = p.parse_args(argv)
    with single_process():  # no process group here: DCP's warning about that says nothing
        if args.command == "to-consolidated":
            run_or_exit(lambda: to_consolidated(args.load, args.iteration, args.output, args.overwrite), INPUT_ERRORS)
        elif args.command == "verify":
            print(run_or_exit(lambda: verify_checkpoint(args.load, args.iteration)), flush=True)
        else:
            run_or_exit(lambda: from_consolidated(args.input, args.save), INPUT_ERRORS)


if __name__ == "__main__":
    main()
