"""The offload tiers' cost, measured against what bounds it in the same run: step time of `pretrain_gpt.py`
(world of one) in memory, with the optimizer in host memory, on disk, and at stage 3 with parameters on disk
too, beside this machine's sequential disk bandwidth (O_DIRECT, measured first in --path) and the in-memory
step. Goal (issue 10): the disk tier within 1.25x of max(in-memory step, disk bytes per step / disk bandwidth).

    python bench/bench_offload.py --path /tmp/offload-bench                     # ~100M parameters
    python bench/bench_offload.py --path /data/swap --largest --hidden-size 2560 --num-layers 26
        # by hand: one run at stage 3 with optimizer and parameters on disk, 3 steps (not part of make test)

Each run is a subprocess; its peak RSS is VmHWM, its disk traffic the `zero comm` line's counted bytes.
"""

from __future__ import annotations

import argparse
import mmap
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = """
import sys, pretrain_gpt
pretrain_gpt.main(sys.argv[1:])
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print("VmHWM", int(status["VmHWM"].split()[0]) * 1024)
"""
MODES = {
    "in memory": [],
    "optimizer cpu": ["--offload-optimizer", "cpu"],
    "optimizer disk": ["--offload-optimizer", "disk"],
    "stage 3, optimizer + params disk": ["--zero-stage", "3", "--offload-optimizer", "disk", "--offload-params", "disk"],
}


def disk_bandwidth(path: str, nbytes: int) -> tuple[float, float]:
    """(write, read) bytes/s of one sequential pass over a fresh file with O_DIRECT (buffered if refused)."""
    os.makedirs(path, exist_ok=True)
    name, block = os.path.join(path, "bandwidth.bin"), 64 << 20
    buffer = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buffer.write(os.urandom(1 << 20) * (block >> 20))
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(name, flags | os.O_DIRECT)
    except OSError:
        fd = os.open(name, flags)
    try:
        start = time.perf_counter()
        for offset in range(0, nbytes, block):
            os.pwritev(fd, [buffer], offset)
        os.fsync(fd)
        write = nbytes / (time.perf_counter() - start)
        start = time.perf_counter()
        for offset in range(0, nbytes, block):
            os.preadv(fd, [buffer], offset)
        read = nbytes / (time.perf_counter() - start)
    finally:
        os.close(fd)
        os.remove(name)
    return write, read


def run(argv: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", RUN, *argv], capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"run failed: {' '.join(argv)}\n{done.stderr[-3000:]}")
    out = done.stdout
    times = [float(t) for t in re.findall(r"elapsed time per iteration \(ms\): (\S+)", out)]
    losses = [float(x) for x in re.findall(r"lm loss: (\S+)", out)]
    comm = [line for line in out.splitlines() if line.startswith("zero comm")]
    fields = dict(f.strip().rsplit(" ", 1) for f in comm[-1].split("|")[1:]) if comm else {}
    memory = [line for line in out.splitlines() if line.startswith("zero memory")][0]
    params = int(re.search(r"\| params (\d+) \|", memory).group(1))
    disk = float(fields.get("disk-read bytes/iter", 0)) + float(fields.get("disk-written bytes/iter", 0))
    return {"ms": statistics.median(times[1:]) if len(times) > 1 else times[0], "disk": disk, "params": params,
            "rss": int(out.split("VmHWM")[-1]), "memory": memory, "losses": losses}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", required=True, help="directory on the disk to measure (the disk tier's files)")
    p.add_argument("--hidden-size", type=int, default=768)
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--sub-group", type=int, default=16_777_216)
    p.add_argument("--largest", action="store_true", help="one run: stage 3, optimizer and parameters on disk")
    p.add_argument("--grad-reduce-in-bf16", action="store_true", help="bf16 gradients (2 bytes, not fp32's 4)")
    args = p.parse_args()
    heads = max(args.hidden_size // 64, 1)
    common = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size), "--num-attention-heads",
              str(heads), "--seq-length", str(args.seq_length), "--micro-batch-size", "1", "--train-iters",
              str(args.iters), "--lr", "1e-4", "--mock-data", "--vocab-size", "32000", "--eval-iters", "0",
              "--log-interval", "1", "--bf16", "--zero-stage", "2", "--offload-sub-group-numel", str(args.sub_group)]
    if args.grad_reduce_in_bf16:
        common.append("--grad-reduce-in-bf16")
    swap = os.path.join(args.path, "swap")
    shutil.rmtree(swap, ignore_errors=True)
    print(f"load {os.getloadavg()[0]:.2f}; torch threads: default; disk: {args.path}", flush=True)
    write, read = disk_bandwidth(args.path, 2 << 30)
    print(f"disk sequential (O_DIRECT, 2 GiB, 64 MiB requests): write {write / 1e9:.2f} GB/s, "
          f"read {read / 1e9:.2f} GB/s", flush=True)
    modes = {"largest": MODES["stage 3, optimizer + params disk"]} if args.largest else MODES
    results = {}
    for name, flags in modes.items():
        extra = ["--offload-path", swap] if "disk" in flags else []
        results[name] = run(common + flags + extra)
        shutil.rmtree(swap, ignore_errors=True)
        r = results[name]
        print(f"{name}: {r['params']} parameters, {r['ms']:.0f} ms/iter, disk {r['disk'] / 1e9:.2f} GB/iter, "
              f"peak RSS {r['rss'] / 2**30:.2f} GiB, losses {r['losses']}\n  {r['memory']}", flush=True)
    bandwidth = 2 / (1 / write + 1 / read)  # half the bytes are read, half written
    if args.largest:
        r = results["largest"]
        print(f"disk bound {r['disk'] / bandwidth:.1f} s/iter; measured {r['ms'] / 1000:.1f} s/iter "
              f"({r['ms'] / 1000 / (r['disk'] / bandwidth):.2f}x the disk bound)", flush=True)
        return
    base = results["in memory"]["ms"] / 1000
    print("\n| mode | ms/iter | x in memory | disk GB/iter | bound ms | x bound | peak RSS GiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        bound = max(base, r["disk"] / bandwidth)
        print(f"| {name} | {r['ms']:.0f} | {r['ms'] / 1000 / base:.2f} | {r['disk'] / 1e9:.2f} | {bound * 1000:.0f} | "
              f"{r['ms'] / 1000 / bound:.2f} | {r['rss'] / 2**30:.2f} |")


if __name__ == "__main__":
    main()
