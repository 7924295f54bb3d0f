"""One pretrain_gpt run whose history (per-iteration losses, ...) global rank 0 writes as JSON:

    python3 -m tests.gpu.check.train_run --json out.json -- <pretrain_gpt flags>
    python3 -m torch.distributed.run --standalone --nproc_per_node 4 -m tests.gpu.check.train_run --json out.json -- ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="python3 -m tests.gpu.check.train_run")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv[:split])
    import pretrain_gpt  # the repository root is on PYTHONPATH
    from mpzero.files import write_atomically
    history = pretrain_gpt.main(argv[split + 1:])
    if int(os.environ.get("RANK", "0")) == 0:
        write_atomically(args.json, json.dumps(history) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
