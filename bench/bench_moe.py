"""Seconds per forward and backward of one mixture-of-experts layer on the CPU: mpzero's `MoELayer` (EP 1, the
allgather dispatcher Megatron defaults to and the alltoall one; experts as the per-expert loop and as
`torch._grouped_mm`) against a plain eager PyTorch MoE written here (a softmax top-k router in fp32 and a loop over
experts with index_select / index_add_, the usual reference MoE) and against Megatron-Core's MoELayer (when
`megatron-core` is installed: its local spec, SequentialMLP experts, the allgather dispatcher), in the same run.
Same spec for every variant: SwiGLU experts without biases, dropless top-k, the Switch aux loss on (its gradient
included in the step). The variants take turns round by round (median of --steps after 2 warm-up rounds), each
ratio the median over rounds of the ratio within a round, so a shared machine's load falls on all of them.

    python bench/bench_moe.py [--tokens 2048 --hidden-size 256 --ffn-hidden-size 512 --num-experts 8 --topk 2
                               --steps 10 --threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

from mpzero.comm import CommGroup
from mpzero.deferred_init import materialize_module, name_parameters
from mpzero.models import GPTConfig
from mpzero.models.blocks import normal_init
from mpzero.models.moe_block import ExpertGrid, moe_block
from mpzero.moe import MoEMetrics, experts_impl
from mpzero.parallel import init_parallel


class EagerMoE(nn.Module):
    """Router (fp32 logits, softmax over the k chosen, Switch aux loss), then each expert on its tokens."""

    def __init__(self, h, f, experts, k, aux_coeff):
        super().__init__()
        self.k, self.experts, self.aux_coeff = k, experts, aux_coeff
        self.router = nn.Linear(h, experts, bias=False)
        self.gate_up = nn.Parameter(torch.randn(experts, 2 * f, h) * 0.02)
        self.down = nn.Parameter(torch.randn(experts, h, f) * 0.02)

    def forward(self, x):
        b, s, h = x.shape
        tokens = x.reshape(-1, h)
        logits = self.router(tokens.float())
        top, indices = logits.topk(self.k, dim=-1)
        gates = top.softmax(dim=-1)
        probs = logits.softmax(dim=-1)
        counts = torch.zeros_like(probs).scatter(1, indices, 1.0).sum(0)
        aux = (probs.sum(0) * counts).sum() * self.experts * self.aux_coeff / (self.k * tokens.shape[0] ** 2)
        out = torch.zeros_like(tokens)
        for e in range(self.experts):
            token, slot = (indices == e).nonzero(as_tuple=True)
            gate, up = (tokens[token] @ self.gate_up[e].t()).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.down[e].t()
            out.index_add_(0, token, y * gates[token, slot].unsqueeze(-1).to(y.dtype))
        return out.view(b, s, h), aux


def mpzero_layer(a, dispatcher: str, grouped: bool):
    config = GPTConfig(num_layers=1, hidden_size=a.hidden_size, num_attention_heads=4, vocab_size=128,
                       max_position_embeddings=a.tokens, swiglu=True, add_bias_linear=False,
                       num_experts=a.num_experts, moe_ffn_hidden_size=a.ffn_hidden_size, moe_router_topk=a.topk,
                       moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=grouped)
    one = CommGroup(None, (0,), 0)
    grid = ExpertGrid(one, one, MoEMetrics([True], a.num_experts))
    layer = moe_block(config, 0, one, grid, normal_init(0.02), normal_init(0.02), F.silu)
    name_parameters(layer, seed=0)
    materialize_module(layer)
    return layer


def megatron_core_step(a, dispatcher: str):
    """Megatron-Core's MoELayer with the same spec (its local spec: SequentialMLP experts, TopKRouter, the
    dispatcher named: allgather on a CPU, its alltoall makes a CUDA stream), or None when megatron-core is not
    installed. On the CPU as bench_llama.py runs it: a tracker that never draws, `torch.cuda.current_device()`
    answering "cpu" (where its router moves its weight), and the router's GEMM path told that Transformer Engine
    is absent (0.16.1 leaves `te_general_gemm` undefined without it)."""
    try:
        from megatron.core import parallel_state
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.tensor_parallel import random as megatron_random
        from megatron.core.transformer.moe.moe_layer import MoELayer as MegatronMoE
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError:
        return None

    class _NoDrawTracker:  # dropout 0: the experts' fork draws nothing
        def fork(self, name=None):
            return contextlib.nullcontext()
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16.1 names it only where Transformer Engine imports
        moe_utils.te_general_gemm = None
    megatron_random._CUDA_RNG_STATE_TRACKER = _NoDrawTracker()
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)  # over the gloo world of one that init_parallel made
    config = TransformerConfig(
        num_layers=1, hidden_size=a.hidden_size, num_attention_heads=4, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, num_moe_experts=a.num_experts, moe_ffn_hidden_size=a.ffn_hidden_size,
        moe_router_topk=a.topk, moe_aux_loss_coeff=1e-2, moe_router_dtype="fp32",
        moe_token_dispatcher_type=dispatcher)
    spec = get_moe_module_spec(use_te=False, num_experts=a.num_experts, moe_grouped_gemm=False)
    with mock.patch("torch.cuda.current_device", lambda: "cpu"):
        layer = MegatronMoE(config, spec.submodules)

    def step(x):
        with mock.patch("torch.cuda.current_device", lambda: "cpu"):
            out, _ = layer(x.transpose(0, 1))  # Megatron's [s, b, h]
        out.square().mean().backward()  # the aux loss reaches the gradient through MoEAuxLossAutoScaler
    return step


def _mpzero_step(layer):
    def step(x):
        layer(x).square().mean().backward()  # the aux loss reaches the gradient through the layer's output
    return step


def _eager_step(model):
    def step(x):
        out, aux = model(x)
        (out.square().mean() + aux).backward()
    return step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--ffn-hidden-size", type=int, default=512)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (1: steadier on a shared machine)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    x = torch.randn(1, a.tokens, a.hidden_size)
    variants = {"eager": _eager_step(EagerMoE(a.hidden_size, a.ffn_hidden_size, a.num_experts, a.topk, 1e-2))}
    for dispatcher in ("allgather", "alltoall"):
        variants[f"mpzero {dispatcher} loop"] = _mpzero_step(mpzero_layer(a, dispatcher, False))
    if experts_impl(True) == "grouped_mm":
        variants["mpzero alltoall grouped_mm"] = _mpzero_step(mpzero_layer(a, "alltoall", True))
    init_parallel(1)  # the gloo world of one megatron-core's parallel state is made over
    megatron = megatron_core_step(a, "allgather")  # its alltoall dispatcher makes a CUDA stream: GPU only
    if megatron is None:
        print("megatron-core is not installed: no megatron-core row (pip install megatron-core)")
    else:
        variants["megatron-core allgather"] = megatron
    rounds = []
    for i in range(a.steps + 2):
        times = {}
        for name, step in variants.items():
            start = time.perf_counter()
            step(x)
            times[name] = time.perf_counter() - start
        if i >= 2:
            rounds.append(times)
    print(f"moe layer fwd+bwd | tokens {a.tokens} | h {a.hidden_size} | f {a.ffn_hidden_size} | experts "
          f"{a.num_experts} | top-{a.topk} | threads {torch.get_num_threads()}")
    baselines = [b for b in ("eager", "megatron-core allgather") if b in variants]
    for name in variants:
        seconds = statistics.median(r[name] for r in rounds)
        ratios = " | ".join(f"{statistics.median(r[name] / r[b] for r in rounds):.2f}x {b}" for b in baselines)
        print(f"{name:28s} | {seconds * 1e3:8.1f} ms | {ratios}")
    return rounds


if __name__ == "__main__":
    main()
