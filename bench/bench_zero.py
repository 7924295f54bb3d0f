"""Step time and per-rank model-state bytes of mpzero's ZeRO stages 0-3 against torch's peers.

    python -m bench.bench_zero [--world-sizes 2 4] [--iters 8] [--hidden-size 128 --num-layers 4]

One tiny GPT-like model (torch.nn blocks, tied output projection), fp32, gloo on CPU, ranks forked,
same data for every configuration. Peers at the same stage, measured in the same run:
stage 0 ~ torch DDP (gradient_as_bucket_view), stage 1 ~ DDP + ZeroRedundancyOptimizer,
stage 2 ~ FSDP2 `fully_shard(reshard_after_forward=False)` (parameters kept from forward to backward,
gradients sharded), stage 3 ~ FSDP2 `fully_shard(reshard_after_forward=True)`. Every run clips at 1.0
and uses AdamW. Model-state bytes = unique storages of parameters, gradients and optimizer states
this rank holds after a step (mpzero: its own memory report, padding included).
Printed per world size: step ms, step time / peer, bytes, bytes / peer, bytes / ZeRO formula.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import mark_replicated
from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer
from mpzero.storages import unique_storage_bytes
from tests.distributed import run_ranks

PEERS = {"mpzero stage 0": "torch DDP", "mpzero stage 1": "torch ZeroRedundancyOptimizer",
         "mpzero stage 2": "FSDP2 no reshard", "mpzero stage 3": "FSDP2 reshard"}


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        self.heads = heads

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, seq: int):
        super().__init__()
        self.word_embeddings, self.position_embeddings = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.layers = nn.ModuleList(Block(hidden, hidden // 64) for _ in range(layers))
        self.final_layernorm = nn.LayerNorm(hidden)

    def forward(self, tokens, labels):
        x = self.word_embeddings(tokens) + self.position_embeddings.weight[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        logits = self.final_layernorm(x) @ self.word_embeddings.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def _torch_peer(name: str, model: nn.Module, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    if name.startswith("FSDP2"):
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=(name == "FSDP2 reshard"))
        wrapped = fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        wrapped = DistributedDataParallel(model, gradient_as_bucket_view=True)
        opt = (torch.optim.AdamW(model.parameters(), lr=1e-4) if name == "torch DDP" else
               ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4))

    def step(tokens, labels):
        wrapped(tokens, labels).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    def state_bytes():
        local = [getattr(t, "_local_tensor", t) for p in model.parameters() for t in (p, p.grad) if t is not None]
        inner = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
        states = [getattr(t, "_local_tensor", t) for s in inner.state.values() for t in s.values()]
        return unique_storage_bytes(local + states), None
    return step, state_bytes, lambda: opt.zero_grad(set_to_none=False)


def _mpzero(stage: int, model: nn.Module, groups):
    opt = ZeroOptimizer(mark_replicated(model), groups, ZeroConfig(stage=stage), AdamConfig(lr=1e-4, clip_grad=1.0), PrecisionConfig())

    def step(tokens, labels):
        opt.backward(model(tokens, labels), last_micro_batch=True)
        opt.step()

    def state_bytes():
        report = opt.memory_report()
        return report.measured, report.ratio
    return step, state_bytes, lambda: None


def _bench_rank(name: str, args) -> tuple[float, int, float | None]:
    torch.manual_seed(0)
    groups = init_parallel(tp_size=1)
    model = TinyGPT(args.vocab_size, args.hidden_size, args.num_layers, args.seq_length)
    if name.startswith("mpzero"):
        step, state_bytes, zero_grad = _mpzero(int(name[-1]), model, groups)
    else:
        step, state_bytes, zero_grad = _torch_peer(name, model, groups.dp_size)
    gen = torch.Generator().manual_seed(1 + groups.dp_rank)
    shape = (args.micro_batch_size, args.seq_length)
    tokens, labels = (torch.randint(0, args.vocab_size, shape, generator=gen) for _ in range(2))
    times = []
    for i in range(args.warmup + args.iters):
        dist.barrier()
        start = time.perf_counter()
        step(tokens, labels)
        dist.barrier()
        times.append(time.perf_counter() - start)
        if i < args.warmup + args.iters - 1:
            zero_grad()
    measured, formula_ratio = state_bytes()
    return sorted(times[args.warmup:])[len(times[args.warmup:]) // 2], measured, formula_ratio


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=2048)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # forked ranks deadlock if the parent started a multi-thread pool
    names = list(PEERS) + list(PEERS.values())
    for world in args.world_sizes:
        results = {name: max(run_ranks(world, _bench_rank, name, args, deadline=600)) for name in names}
        print(f"\nworld {world} (gloo, CPU, 1 thread per rank, median of {args.iters} steps)")
        print(f"{'config':32s} {'step ms':>8s} {'/ peer':>7s} {'state bytes':>12s} {'/ peer':>7s} {'/ formula':>9s}")
        for name in names:
            ms, nbytes, formula = results[name]
            peer = results.get(PEERS.get(name, name))
            print(f"{name:32s} {ms * 1e3:8.1f} {ms / peer[0]:7.2f} {nbytes:12d} {nbytes / peer[1]:7.2f} "
                  f"{'' if formula is None else f'{formula:.4f}':>9s}")


if __name__ == "__main__":
    main()
