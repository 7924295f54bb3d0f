"""Published model-state figures, recomputed: the ZeRO paper's Table 1 through mpzero's own formula, and
DeepSpeed's estimators through their own conventions written in mpzero's terms, beside mpzero's figure for the
same model and layout. Tests check that the published numbers come out; the planner's report explains the gaps.

ZeRO Table 1 (Rajbhandari et al., SC'20): per-device model states of mixed-precision Adam with fp16 parameters
and gradients, K = 12 = `accounting.memory_formula(stage, p=2, g=2, master=4)`: 16P, 4P + 12P/N, 2P + 14P/N,
16P/N. GB there are 10^9 bytes.

DeepSpeed's estimators (`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`, printed
per CPU (a node's host memory) and per GPU in GiB) count, per parameter: 2 bytes of fp16 parameter, 2 of fp16
gradient, 16 of fp32 state (master, Adam's m and v: mpzero's K = 12, plus an fp32 gradient copy: 4), times an
`additional_buffer_factor` of 1.5 on the host; and on the GPU `4 x the largest layer` for ZeRO-3's gathered
parameters and gradients (fp16 p + g of one layer). In mpzero's terms: DeepSpeed's 18 is
`state_terms(3, p=2, g=4, master=4)` summed (2 + 4 + 12: mpzero's bf16 ZeRO-3, 18P/N, has the same fp32 gradient
partition), its offloaded host state 16 = K + the fp32 gradient and 18 = that + the fp16 parameter.
mpzero differs where it holds things elsewhere: offloaded, its gradients stay on the device (gP/N) and reach the
host through bounded staging buffers (no fp32 gradient copy, no 1.5 factor: the buffers are counted exactly), and
its in-step working set is (p + g)(R + 2L) (the root and two layers with prefetch, gradients in flight), not 4L.
"""

from __future__ import annotations

from mpzero.optim import AdamW
from mpzero.zero import memory_formula, offload_formula, state_terms

ADAM = AdamW().state_bytes_per_param  # the ZeRO paper and DeepSpeed count mixed-precision Adam: 8 of moments

DS_BUFFER_FACTOR = 1.5  # DeepSpeed's additional_buffer_factor


def zero_table1_bytes(params: float, dp: int, stage: int) -> float:
    """Per-device model-state bytes of the ZeRO paper's Table 1 (fp16 mixed-precision Adam), by mpzero's formula."""
    replicated, partitioned = memory_formula(stage, p=2, g=2, master=4, states=ADAM)
    return params * (replicated + partitioned / dp)


def deepspeed_zero3(total: int, largest_layer: int, gpus_per_node: int = 1, nodes: int = 1,
                    offload_optimizer: bool = True, offload_params: bool = True,
                    zero_init: bool = True) -> tuple[int, int]:
    """(host bytes per node, device bytes per GPU) as DeepSpeed's ZeRO-3 estimator computes them."""
    gpus, per_node = gpus_per_node * nodes, 1 / nodes
    all_states = sum(sum(t) for t in state_terms(3, p=2, g=4, master=4, states=ADAM).values())  # 18: p16 + fp32 g, master, m, v
    layer = 4 * largest_layer  # fp16 parameters and gradients of the largest layer, gathered
    if offload_optimizer and offload_params:
        device = layer
        host = total * (all_states * per_node if zero_init else max(4 * gpus_per_node, all_states * per_node))
    elif offload_optimizer:
        device = layer + int(2 * total / gpus)  # the fp16 parameter partition
        host_state = all_states - 2  # 16: fp32 gradient, master, m, v
        host = total * (host_state * per_node if zero_init else max(4 * gpus_per_node, host_state * per_node))
    else:
        device = layer + int(all_states * total / gpus)
        host = (largest_layer if zero_init else total) * 4 * gpus_per_node
    return int(host * DS_BUFFER_FACTOR), int(device)


def deepspeed_zero2(total: int, gpus_per_node: int = 1, nodes: int = 1,
                    offload_optimizer: bool = True) -> tuple[int, int]:
    """(host bytes per node, device bytes per GPU) as DeepSpeed's ZeRO-2 estimator computes them."""
    gpus = gpus_per_node * nodes
    if offload_optimizer:
        return int(total * max(4 * gpus, 16) * DS_BUFFER_FACTOR), 2 * total  # fp16 parameters stay whole
    return int(total * 4 * gpus_per_node * DS_BUFFER_FACTOR), int(4 * total + 16 * total / gpus)


def mpzero_from_counts(total: int, largest_layer: int, dp: int, stage: int, p: int, g: int,
                       offload_optimizer: str = "none", offload_params: str = "none") -> tuple[float, float]:
    """(host bytes per rank, device bytes per rank at the in-step peak) by mpzero's formulas for a model known only
    by its counts: model states from `memory_formula`/`offload_formula`, and for stage 3 the working set
    (p + g)(R + 2L) with the root R and the layers L taken as the largest layer (an upper bound; the planner's
    exact figure needs the model)."""
    tiers = {"optimizer": offload_optimizer, "params": offload_params,  # gradients streamed to the host (issue 24),
             "grads": offload_optimizer if stage >= 2 else "none"}      # and on to disk beside a disk optimizer
    offloaded = tuple(c for c, t in tiers.items() if t != "none")
    replicated, partitioned = memory_formula(stage, p, g, 4, ADAM, offloaded)
    device = total * (replicated + partitioned / dp)
    if stage == 3:
        device += (p + g) * 3 * largest_layer
    host = sum(offload_formula(stage, p, g, tiers, ADAM).values()) * total / dp
    return host, device
