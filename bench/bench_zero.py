"""Step time and per-rank model-state bytes of mpzero's ZeRO stages 0-3 against torch's and DeepSpeed's peers.

    python -m bench.bench_zero [--world-sizes 2 4] [--iters 8] [--rounds 3] [--hidden-size 128 --num-layers 4]
    python -m bench.bench_zero --world-sizes 2 --hidden-size 256 --vocab-size 8192 --seq-length 256   # 5.3M

One tiny GPT-like model (torch.nn blocks, tied output projection), fp32, gloo on CPU, ranks forked,
same data for every configuration. Peers at the same stage, measured in the same run:
stage 0 ~ torch DDP (gradient_as_bucket_view), stage 1 ~ DDP + ZeroRedundancyOptimizer,
stage 2 ~ FSDP2 `fully_shard(reshard_after_forward=False)` (parameters kept from forward to backward,
gradients sharded), stage 3 ~ FSDP2 `fully_shard(reshard_after_forward=True)`; and DeepSpeed's engine at
ZeRO stages 0-3 when it is installed (`pip install deepspeed`; its CPU accelerator and the run's gloo group).
Every run clips at 1.0 and uses AdamW; the peers' AdamW is torch's fused kernel (`fused=True`, the kernel
mpzero's step runs on a CPU; --peer-adam default gives torch's default for-loop AdamW instead).
Model-state bytes = unique storages of parameters, gradients and optimizer states this rank holds after a
step (mpzero: its own memory report, padding included; DeepSpeed's are not counted: "-").
Printed per world size: step ms (the median over --rounds interleaved rounds of each round's median of --iters
steps, and the rounds' min-max), step time / torch's peer, / the best peer at that stage (by medians, and by each
config's least disturbed round: on a shared machine a round that another job slowed is 2x, not 10%, off), where
the step's time goes (forward, backward with its gradient reduction, update: clipping, AdamW and what follows it;
medians, each phase ended by a barrier), bytes, bytes / torch's peer, bytes / ZeRO formula. The floor rows are each
rank's forward and backward with no communication, without and with the whole model's clipping and fused AdamW
(what every stage-0 step runs); "floor / best peer" bounds from below the step any implementation of a stage reaches
against that stage's fastest peer (stage 0: the floor with the update).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import mark_replicated
from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer
from mpzero.storages import unique_storage_bytes
from tests.distributed import RanksFailed, run_ranks

PEERS = {"mpzero stage 0": ("torch DDP", "DeepSpeed ZeRO-0"),
         "mpzero stage 1": ("torch ZeroRedundancyOptimizer", "DeepSpeed ZeRO-1"),
         "mpzero stage 2": ("FSDP2 no reshard", "DeepSpeed ZeRO-2"),
         "mpzero stage 3": ("FSDP2 reshard", "DeepSpeed ZeRO-3")}
FLOOR = "floor: forward + backward alone"
FLOOR_UPDATE = "floor + the whole model's update"


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


def _peer_adamw(params, args) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, fused=True if args.peer_adam == "fused" else None)


def _torch_peer(name: str, model: nn.Module, world: int, args):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    if name.startswith("FSDP2"):
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=(name == "FSDP2 reshard"))
        wrapped = fully_shard(model, mesh=mesh)
        opt = _peer_adamw(model.parameters(), args)
    else:
        wrapped = DistributedDataParallel(model, gradient_as_bucket_view=True)
        opt = (_peer_adamw(model.parameters(), args) if name == "torch DDP" else
               ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4,
                                       fused=True if args.peer_adam == "fused" else None))

    def update():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    def state_bytes():
        local = [getattr(t, "_local_tensor", t) for p in model.parameters() for t in (p, p.grad) if t is not None]
        inner = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
        states = [getattr(t, "_local_tensor", t) for s in inner.state.values() for t in s.values()]
        return unique_storage_bytes(local + states), None
    return (wrapped, lambda loss: loss.backward(), update), state_bytes, lambda: opt.zero_grad(set_to_none=False)


def _deepspeed(stage: int, model: nn.Module, args):
    """DeepSpeed's engine at ZeRO `stage` on this rank's gloo world, with the peers' AdamW as its client optimizer."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed asserts its launcher's variables; the world itself is the one run_ranks made
    rank, world = str(dist.get_rank()), str(dist.get_world_size())
    os.environ.update(LOCAL_RANK=rank, RANK=rank, WORLD_SIZE=world)
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    config = {"train_micro_batch_size_per_gpu": args.micro_batch_size, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": stage}, "steps_per_print": 2 ** 31}
    engine, *_ = deepspeed.initialize(model=model, optimizer=_peer_adamw(model.parameters(), args), config=config,
                                      dist_init_required=False)

    return (engine, engine.backward, engine.step), lambda: (None, None), lambda: None  # step() zeroes the gradients


def _mpzero(stage: int, model: nn.Module, groups):
    opt = ZeroOptimizer(mark_replicated(model), groups, ZeroConfig(stage=stage), AdamConfig(lr=1e-4, clip_grad=1.0),
                        PrecisionConfig())

    def state_bytes():
        report = opt.memory_report()
        return report.measured, report.ratio
    return (model, lambda loss: opt.backward(loss, last_micro_batch=True), opt.step), state_bytes, lambda: None


def _floor(model: nn.Module, args, update: bool):
    """Each rank's forward and backward alone, no communication; with `update`, also the clipping and fused AdamW
    over the whole model that every stage-0 (DDP) step runs. No data-parallel step at any stage takes less than the
    first, nor at stage 0 than the second: floor / best peer bounds what any implementation reaches."""
    opt = _peer_adamw(model.parameters(), args)

    def step():
        if update:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return ((model, lambda loss: loss.backward(), step), lambda: (None, None),
            lambda: model.zero_grad(set_to_none=False))


def _bench_rank(name: str, args) -> tuple[list[float], int | None, float | None]:
    """This rank's median seconds of [the step, its forward, its backward, its update], its state bytes and their
    ratio to the formula. Each phase ends at a barrier: the slowest rank's time."""
    torch.manual_seed(0)
    groups = init_parallel(tp_size=1)
    model = TinyGPT(args.vocab_size, args.hidden_size, args.num_layers, args.seq_length)
    if name in (FLOOR, FLOOR_UPDATE):
        (forward, backward, update), state_bytes, zero_grad = _floor(model, args, update=name == FLOOR_UPDATE)
    elif name.startswith("mpzero"):
        (forward, backward, update), state_bytes, zero_grad = _mpzero(int(name[-1]), model, groups)
    elif name.startswith("DeepSpeed"):
        (forward, backward, update), state_bytes, zero_grad = _deepspeed(int(name[-1]), model, args)
    else:
        (forward, backward, update), state_bytes, zero_grad = _torch_peer(name, model, groups.dp_size, args)
    gen = torch.Generator().manual_seed(1 + groups.dp_rank)
    shape = (args.micro_batch_size, args.seq_length)
    tokens, labels = (torch.randint(0, args.vocab_size, shape, generator=gen) for _ in range(2))
    times = []
    for i in range(args.warmup + args.iters):
        dist.barrier()
        marks = [time.perf_counter()]
        loss = forward(tokens, labels)
        for phase in (lambda: None, lambda: backward(loss), update):
            phase()
            dist.barrier()
            marks.append(time.perf_counter())
        times.append([marks[3] - marks[0], marks[1] - marks[0], marks[2] - marks[1], marks[3] - marks[2]])
        if i < args.warmup + args.iters - 1:
            zero_grad()
    measured, formula_ratio = state_bytes()
    return [statistics.median(column) for column in zip(*times[args.warmup:])], measured, formula_ratio


def _rounds(world: int, names: list[str], args) -> dict[str, tuple[list[list[float]], int | None, float | None]]:
    """Each config's per-round medians ([step, forward, backward, update] seconds of the slowest rank; rounds
    interleaved), its state bytes and formula ratio; a DeepSpeed config that fails is reported and dropped."""
    results = {name: ([], None, None) for name in names}
    for _ in range(args.rounds):
        for name in list(results):
            try:
                seconds, nbytes, formula = max(run_ranks(world, _bench_rank, name, args, deadline=900),
                                               key=lambda rank: rank[0][0])
            except RanksFailed as failure:
                if not name.startswith("DeepSpeed"):
                    raise
                print(f"{name}: failed, left out: {str(failure).strip().splitlines()[-1]}")
                del results[name]
                continue
            results[name] = (results[name][0] + [seconds], nbytes, formula)
    return results


def _print_world(world: int, results, args) -> None:
    print(f"\nworld {world} (gloo, CPU, 1 thread per rank, median of {args.rounds} rounds of {args.iters} steps, "
          f"peers' AdamW: {args.peer_adam})")
    print(f"{'config':32s} {'step ms':>8s} {'(rounds min-max)':>17s} {'/ peer':>6s} {'/ best':>6s} {'(mins)':>6s} "
          f"{'fwd':>6s} {'bwd':>6s} {'update':>6s} {'state bytes':>11s} {'/ peer':>6s} {'/ formula':>9s}")
    ms = {name: statistics.median(r[0] for r in rounds) for name, (rounds, _, _) in results.items()}
    least = {name: min(r[0] for r in rounds) for name, (rounds, _, _) in results.items()}  # least disturbed round
    for name, (rounds, nbytes, formula) in results.items():
        peers = [peer for peer in PEERS.get(name, (name,)) if peer in results]
        best, best_min = min(ms[p] for p in peers), min(least[p] for p in peers)
        phases = " ".join(f"{statistics.median(r[k] for r in rounds) * 1e3:6.1f}" for k in (1, 2, 3))
        peer_bytes = results[peers[0]][1]
        size = "-" if nbytes is None else str(nbytes)
        size_ratio = "-" if nbytes is None or peer_bytes is None else f"{nbytes / peer_bytes:.2f}"
        spread = f"({least[name] * 1e3:.1f}-{max(r[0] for r in rounds) * 1e3:.1f})"
        print(f"{name:32s} {ms[name] * 1e3:8.1f} {spread:>17s} {ms[name] / ms[peers[0]]:6.2f} {ms[name] / best:6.2f} "
              f"{least[name] / best_min:6.2f} {phases} {size:>11s} {size_ratio:>6s} "
              f"{'' if formula is None else f'{formula:.4f}':>9s}")
    if FLOOR in results:  # what no implementation goes below, against each stage's best peer (issue 47's 0.9x)
        bounds = []
        for stage, stage_peers in enumerate(PEERS.values()):
            best = min((ms[p], p) for p in stage_peers if p in results)
            floor = ms[FLOOR_UPDATE] if stage == 0 else ms[FLOOR]
            bounds.append(f"stage {stage} {floor / best[0]:.2f} ({best[1]})")
        print(f"{'floor / best peer':32s} " + ", ".join(bounds) + " (stage 0: with the update)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds over all configurations")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--peer-adam", choices=["fused", "default"], default="fused")
    parser.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed's engine out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # forked ranks deadlock if the parent started a multi-thread pool
    names = list(PEERS) + [peers[0] for peers in PEERS.values()] + [FLOOR, FLOOR_UPDATE]
    if args.no_deepspeed or importlib.util.find_spec("deepspeed") is None:
        print("DeepSpeed: left out" + ("" if args.no_deepspeed else " (not installed: pip install deepspeed)"))
    else:
        names += [peers[1] for peers in PEERS.values()]
    for world in args.world_sizes:
        _print_world(world, _rounds(world, names, args), args)


if __name__ == "__main__":
    main()
