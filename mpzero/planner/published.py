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

Published MoE layouts (`PUBLISHED_MOE`): Mixtral 8x7B, a DeepSeek-V3-sized MoE and Qwen3-30B-A3B at their
published layouts, the flags the planner and the dry run take (bench/bench_moe_planner.py, tests/test_moe_plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class PublishedLayout:
    """A published model at its published layout: pretrain_gpt.py's model flags, the layout's flags, the world, the
    ranks worth a dry run (each pipeline stage kind), and where the figures come from."""
    name: str
    model: tuple[str, ...]
    layout: tuple[str, ...]
    world: int
    ranks: tuple[int, ...]
    source: str


# Mixtral 8x7B (Mistral's config: 32 layers, h 4096, 32 heads, 8 KV groups, experts of 14336, 8 experts top-2,
# vocabulary 32000, sequence 4096) at Megatron's Mixtral example layout TP 1 x EP 8 x PP 4, bf16, distributed
# optimizer; 32 GPUs (EP 8 folds over DP 8), global batch 256, interleaved v 2, full recomputation.
MIXTRAL_8X7B = PublishedLayout(
    "Mixtral 8x7B",
    ("--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--group-query-attention",
     "--num-query-groups", "8", "--ffn-hidden-size", "14336", "--num-experts", "8", "--moe-router-topk", "2",
     "--moe-ffn-hidden-size", "14336", "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall",
     "--moe-grouped-gemm", "--vocab-size", "32000", "--seq-length", "4096", "--max-position-embeddings", "4096",
     "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--no-position-embedding",
     "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--bf16", "--attention-dropout", "0",
     "--hidden-dropout", "0", "--global-batch-size", "256", "--micro-batch-size", "1"),
    ("--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4",
     "--num-virtual-stages-per-pipeline-rank", "2", "--expert-model-parallel-size", "8", "--use-distributed-optimizer",
     "--zero-stage", "1", "--recompute-granularity", "full", "--recompute-method", "uniform",
     "--recompute-num-layers", "1"),
    32, (0, 31), "Mistral's config; Megatron-LM examples/mixtral (TP 1, PP 4, EP 8)")

# A DeepSeek-V3-sized MoE: 61 layers, h 7168, 128 heads, 256 routed experts of 2048 top-8 in 8 groups (top-4
# groups), sigmoid scores with the expert bias, the gates scaled by 2.5 (routed_scaling_factor), 1 shared expert of
# 2048, the first 3 layers dense (18432), vocabulary 129280. Attention is GQA with 8 KV groups (MLA is not built);
# balancing: the expert bias and a sequence aux loss of 1e-4.
# DeepSeek's published layout PP 16 x EP 64 with ZeRO-1 over DP, 2048 GPUs (DP 128, expert-DP 2), global batch
# 3072 (its first batch size); 61 layers as 3 + 14 x 4 + 2 (DeepSeek's own split used DualPipe, not in mpzero:
# 1F1B here).
DEEPSEEK_V3_SIZED = PublishedLayout(
    "DeepSeek-V3-sized MoE",
    ("--num-layers", "61", "--hidden-size", "7168", "--num-attention-heads", "128", "--group-query-attention",
     "--num-query-groups", "8", "--ffn-hidden-size", "18432", "--num-experts", "256", "--moe-router-topk", "8",
     "--moe-router-num-groups", "8", "--moe-router-group-topk", "4", "--moe-router-score-function", "sigmoid",
     "--moe-router-topk-scaling-factor", "2.5", "--moe-router-enable-expert-bias",
     "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4",
     "--moe-shared-expert-intermediate-size", "2048", "--moe-ffn-hidden-size", "2048", "--moe-layer-freq",
     "([0]*3+[1]*58)", "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm", "--vocab-size", "129280",
     "--seq-length", "4096", "--max-position-embeddings", "4096", "--normalization", "RMSNorm", "--swiglu",
     "--position-embedding-type", "rope", "--no-position-embedding", "--disable-bias-linear",
     "--untie-embeddings-and-output-weights", "--bf16", "--attention-dropout", "0", "--hidden-dropout", "0",
     "--global-batch-size", "3072", "--micro-batch-size", "1", "--decoder-first-pipeline-num-layers", "3",
     "--decoder-last-pipeline-num-layers", "2"),
    ("--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "16", "--expert-model-parallel-size", "64",
     "--use-distributed-optimizer", "--zero-stage", "1", "--recompute-granularity", "full", "--recompute-method",
     "uniform", "--recompute-num-layers", "1"),
    2048, (0, 128, 2047), "DeepSeek-V3 technical report (arXiv 2412.19437): PP 16, EP 64, ZeRO-1")

# Qwen3-30B-A3B (its config.json: 48 layers, h 2048, 32 heads of 128 (--kv-channels 128), 4 KV groups, q/k norms,
# 128 experts of 768 top-8 in every layer, softmax renormalised over the 8, vocabulary 151936, RoPE base 1e6,
# router aux loss 1e-3) at Megatron-Bridge's recipe (qwen3_30b_a3b_pretrain_config: TP 4, PP 2, EP 4, expert-TP 1,
# SP, full uniform recomputation of 1 layer, bf16, distributed optimizer, sequence 4096, micro-batch 2, global
# batch 32) on its smallest world, 8 GPUs (DP 1: EP 4 folds over the 4 TP ranks of each stage, expert-DP 1).
QWEN3_30B_A3B = PublishedLayout(
    "Qwen3-30B-A3B",
    ("--num-layers", "48", "--hidden-size", "2048", "--num-attention-heads", "32", "--kv-channels", "128",
     "--group-query-attention", "--num-query-groups", "4", "--qk-layernorm", "--ffn-hidden-size", "6144",
     "--num-experts", "128", "--moe-router-topk", "8", "--moe-ffn-hidden-size", "768", "--moe-aux-loss-coeff", "1e-3",
     "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm", "--vocab-size", "151936", "--seq-length",
     "4096", "--max-position-embeddings", "40960", "--rotary-base", "1000000", "--normalization", "RMSNorm",
     "--swiglu", "--position-embedding-type", "rope", "--no-position-embedding", "--disable-bias-linear",
     "--untie-embeddings-and-output-weights", "--bf16", "--attention-dropout", "0", "--hidden-dropout", "0",
     "--global-batch-size", "32", "--micro-batch-size", "2"),
    ("--tensor-model-parallel-size", "4", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
     "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1", "--use-distributed-optimizer",
     "--zero-stage", "1", "--recompute-granularity", "full", "--recompute-method", "uniform",
     "--recompute-num-layers", "1"),
    8, (0, 7), "Qwen3-30B-A3B config.json; Megatron-Bridge qwen3_30b_a3b_pretrain_config (TP 4, PP 2, EP 4)")

PUBLISHED_MOE = (MIXTRAL_8X7B, DEEPSEEK_V3_SIZED, QWEN3_30B_A3B)
