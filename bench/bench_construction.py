"""Streamed construction against the whole build: time and resident memory of building a GPT and its ZeRO optimizer
(issue 24's benchmark; not a test).

Each build runs in a fresh process: `GPTModel(..., device="cpu")` (the whole fp32 model first) or `device="meta"`
(`pretrain_gpt.py`'s streamed build), then `ZeroOptimizer` at ZeRO-3 with bf16 parameters, bf16 gradients, the
optimizer and the parameters on disk (the states then hold 2 bytes per parameter in memory, so the build's own
working set shows). Printed per build: seconds, the resident high-water mark the build added (VmHWM; glibc's
mmap threshold fixed at 128 KiB so freed tensors leave the RSS), the `construction-peak` and host working set the
memory line counts, and the streamed/whole ratios. Both builds draw the same weights
(tests/test_streamed_construction.py).

    python bench/bench_construction.py                       # ~1.0B parameters (h 2048, 20 layers), ~2 x 15 GB on disk
    python bench/bench_construction.py --hidden-size 1024 --num-layers 8 --offload-path /nvme/tmp
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BUILD = r"""
import json, sys, time
import torch
from mpzero.models import GPTConfig, GPTModel
from mpzero.parallel import init_parallel
from mpzero.zero import OffloadConfig, OptimizerConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

kind, hidden, layers, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
groups = init_parallel(1)
config = GPTConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=hidden // 128, vocab_size=50257,
                   max_position_embeddings=1024, hidden_dropout=0.0, attention_dropout=0.0)
torch.zeros(1) + 1
before, start = hwm(), time.perf_counter()
model = GPTModel(config, groups.tp, device="meta" if kind == "streamed" else "cpu")
opt = ZeroOptimizer(model, groups, ZeroConfig(stage=3), OptimizerConfig(lr=1e-4),
                    PrecisionConfig("bf16", accumulate_allreduce_grads_in_fp32=False),
                    offload=OffloadConfig(optimizer="disk", params="disk", path=path))
seconds, grown = time.perf_counter() - start, hwm() - before
report = opt.memory_report()
fields = {t.name: t.measured for t in report.construction}
opt.close()
print(json.dumps({"params": opt.numel, "seconds": seconds, "grown": grown, **fields}))
"""


def build(kind: str, args) -> dict:
    with tempfile.TemporaryDirectory(dir=args.offload_path) as folder:
        env = {**os.environ, "PYTHONPATH": ROOT, "MALLOC_MMAP_THRESHOLD_": "131072"}
        out = subprocess.run([sys.executable, "-c", BUILD, kind, str(args.hidden_size), str(args.num_layers),
                              os.path.join(folder, "swap")], capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(out.stderr[-2000:])
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--num-layers", type=int, default=20)
    parser.add_argument("--offload-path", default=None, help="folder for the disk tier (default: the temp folder)")
    args = parser.parse_args()
    results = {kind: build(kind, args) for kind in ("whole", "streamed")}
    for kind, r in results.items():
        print(f"{kind:8} | params {r['params'] / 1e9:.2f}B | {r['seconds']:6.1f} s | VmHWM added "
              f"{r['grown'] / 2 ** 30:6.2f} GiB | construction-peak {r['construction peak'] / 2 ** 30:6.2f} GiB | "
              f"host working set {r['construction host working set'] / 2 ** 20:7.1f} MiB", flush=True)
    whole, streamed = results["whole"], results["streamed"]
    print(f"streamed / whole: time {streamed['seconds'] / whole['seconds']:.3f}x, VmHWM added "
          f"{streamed['grown'] / whole['grown']:.3f}x", flush=True)


if __name__ == "__main__":
    main()
