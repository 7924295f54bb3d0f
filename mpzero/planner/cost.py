"""The planner's cost model: seconds per iteration of a layout, from FLOPs and bytes, stated in full.

    T = max(T_compute (1 + bubble), T_dp, T_fetch) + T_tp + T_cp + T_pp + T_ep + T_offload

- T_compute = FLOPs per rank per iteration / (device peak FLOP/s x efficiency). FLOPs per token are Megatron's
  (`GPTConfig.flops_per_token`, forward + backward = 3 forwards); full recomputation adds one forward of the
  layers (24 l h^2 + 4 l s h per token), selective the core attention's (4 l s h: its two matmuls). A pipeline
  rank computes its own layers' share: the whole model's FLOPs / world x its layers / (L / p), so an uneven
  stage takes longer (the embedding's and the head's FLOPs are not assigned to the ends: a model).
- bubble: the schedule's idle fraction (`planner.pipeline.bubble_fraction`: 1F1B (p-1)/m, interleaved
  (p-1)/(v m), ZB-H1's own); the slowest stage sets the pace of all.
- T_dp = DP bytes per rank per iteration (the `zero comm` figure) / DP bandwidth: overlapped with compute
  (gradient buckets reduce while backward runs, stage 3 prefetches), so only the excess over compute counts.
- T_fetch = stage 3's offloaded parameters read for every gather: host-to-device bytes / PCIe bandwidth, and
  disk reads / this rank's share of the node's disk bandwidth; prefetched, so overlapped with compute too.
- T_tp = TP bytes per rank per iteration / TP bandwidth: on the critical path (each all-reduce waits); a TP group
  larger than a node crosses the network: the DP bandwidth then.
- T_cp = CP bytes per rank per iteration (`mpzero.context_parallel.cp_comm_theory`) / the CP group's bandwidth
  (a node's TP bandwidth when the TP x CP block tiles a node, the DP bandwidth otherwise); all_gather and a2a wait
  for their collectives, the ring (p2p) sends the next K/V while a block computes: only its excess over the
  attention's matmuls (4 l s h per token, forward and backward: 12 l s h) counts.
- T_pp = the pipeline rank's point-to-point bytes per iteration (`planner.pipeline.pipeline_comm_bytes`) / the
  pipeline bandwidth: on the critical path (a stage waits for its input), not overlapped (an upper bound).
- T_ep = a mixture of experts' EP bytes per iteration at balanced routing (`planner.experts.ep_comm_bytes`) / the
  TP bandwidth when the expert-TP x EP block tiles a node (NVLink), the DP bandwidth otherwise: on the critical
  path (a layer waits for its tokens).
- T_offload = the optimizer step off the device, after backward: gradients down and parameters up over PCIe,
  the disk tier's state read and written (K P/N each way, K = 4 + the rule's state bytes: AdamW 12, SGD 8; the
  rank's share of the node's disk bandwidth), and the update on the CPU (this rank's partition / the CPU's AdamW
  rate per rank, taken for any rule).
Throughput = tokens per iteration / T. Memory decides what fits; this model only orders what fits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mpzero.models import family_of


@dataclass(frozen=True)
class Hardware:
    device_tflops: float = 312.0  # dense bf16/fp16 peak per device (A100: 312; H100 SXM: 989; V100: 125)
    efficiency: float = 0.5  # fraction of the peak the matmuls reach
    dp_bandwidth: float = 25e9  # bytes/s per rank for DP collectives (e.g. one 200 Gb/s NIC per GPU)
    tp_bandwidth: float = 150e9  # bytes/s per rank for TP collectives (NVLink within a node)
    pcie_bandwidth: float = 25e9  # bytes/s per rank device<->host
    disk_bandwidth: float = 3e9  # bytes/s per node, read or write
    cpu_adam_rate: float = 1e9  # parameters per second per rank that AdamW on the CPU updates
    gpus_per_node: int = 8
    pp_bandwidth: float = 25e9  # bytes/s per rank for pipeline point-to-point transfers (across nodes)


@dataclass(frozen=True)
class Cost:
    compute: float
    dp: float
    fetch: float
    tp: float
    offload: float
    tokens: int  # per iteration
    cp: float = 0.0
    pp: float = 0.0  # point-to-point seconds (pipeline)
    bubble: float = 0.0  # the schedule's idle time over the compute time
    ep: float = 0.0  # expert-parallel seconds (the dispatchers' exchanges at balanced routing)

    @property
    def seconds(self) -> float:
        return (max(self.compute * (1 + self.bubble), self.dp, self.fetch) + self.tp + self.cp + self.pp
                + self.ep + self.offload)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def flops_per_token(config, tp: int, recompute: str, micro_batch: int = 1) -> float:
    base = family_of(config).flops_per_token(dataclasses.replace(config, recompute_activations=False), tp,
                                             micro_batch)
    l, h = config.num_layers, config.hidden_size
    s = config.seq_length or config.max_position_embeddings
    extra = {"none": 0, "selective": 4 * l * s * h, "full": 24 * l * h ** 2 + 4 * l * s * h}[recompute]
    return base + extra


def layout_cost(config, layout, plan, hw: Hardware, world: int, tp_bytes: float, p: int, cuda: bool = True,
                cp_bytes: float = 0.0, pp_bytes: float = 0.0, share: float = 1.0, bubble: float = 0.0,
                ep_bytes: float = 0.0) -> Cost:
    """The cost of `layout` (a `plan.Layout`) whose model states are `plan` (a `StatePlan`), parameters of `p`
    bytes; `cuda`: the device is a GPU (else device<->host copies cost nothing: the device is the host). A
    pipeline rank: its point-to-point bytes, its layers over the average (`share`), the schedule's `bubble`."""
    tokens = layout.global_batch * (config.seq_length or config.max_position_embeddings)
    flops = flops_per_token(config, layout.tp, layout.recompute, layout.micro_batch) * tokens / world * share
    compute = flops / (hw.device_tflops * 1e12 * hw.efficiency)
    dp = plan.comm_bytes / hw.dp_bandwidth
    ranks_per_node = min(hw.gpus_per_node, world)
    disk = hw.disk_bandwidth / ranks_per_node
    shard = plan.numel / (layout.dp * layout.cp)
    pcie = hw.pcie_bandwidth if cuda else float("inf")
    m = layout.global_batch // (layout.micro_batch * layout.dp)
    fetch = offload = 0.0
    if layout.offload_params != "none":
        fetched = 2 * m * p * shard
        fetch = fetched / pcie + (fetched / disk if layout.offload_params == "disk" else 0.0)
    if layout.offload_optimizer != "none":
        down = 4 * shard
        up = p * shard if layout.offload_params == "none" else 0.0
        offload = (down + up) / pcie + shard / hw.cpu_adam_rate
        if layout.offload_optimizer == "disk":
            offload += 2 * (4 + plan.state_bytes) * shard / disk
        if layout.offload_params == "disk":
            offload += p * shard / disk
    # TP groups are adjacent ranks (parallel.rank_grid): inside a node only when they tile it exactly
    tp_inside_node = ranks_per_node % layout.tp == 0
    tp_bandwidth = hw.tp_bandwidth if tp_inside_node else min(hw.tp_bandwidth, hw.dp_bandwidth)
    cp = 0.0
    if layout.cp > 1:  # CP groups follow TP in the grid: inside a node when the TP x CP block tiles it
        cp_bandwidth = hw.tp_bandwidth if ranks_per_node % (layout.tp * layout.cp) == 0 else hw.dp_bandwidth
        cp = cp_bytes / cp_bandwidth
        if config.cp_comm_type == "p2p":  # overlapped with the attention's blocks
            s = config.seq_length or config.max_position_embeddings
            attention = 12 * config.num_layers * s * config.hidden_size * tokens / world
            cp = max(cp - attention / (hw.device_tflops * 1e12 * hw.efficiency), 0.0)
    # EP groups follow the expert-TP ranks: inside a node when the expert-TP x EP block tiles it
    ep_block = (layout.tp if layout.expert_tp is None else layout.expert_tp) * layout.ep
    ep = ep_bytes / (hw.tp_bandwidth if ranks_per_node % ep_block == 0 else hw.dp_bandwidth)
    return Cost(compute, dp, fetch, tp_bytes / tp_bandwidth, offload, tokens, cp, pp_bytes / hw.pp_bandwidth, bubble,
                ep)
