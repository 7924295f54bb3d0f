"""--torch-compile's regions of the transformer (torchtitan's regional compilation) and --cuda-graph-impl's graphed
trunk: which parts compile, and how."""

from __future__ import annotations

import torch
from torch import nn

from mpzero.models.config import GPTConfig
from mpzero.models.stage import LayerStack


def compile_layers(layers: LayerStack) -> None:
    """torchtitan's regional compilation: each layer's `forward` goes through torch.compile, not the whole model
    and not the module call, so ZeRO-3's gather/release hooks, activation counting and full recomputation stay
    in eager Python around it and parameter names do not change. The layers share one compiled graph (same code,
    same shapes). Inside a layer, what dynamo cannot trace (the tensor-parallel collectives' custom autograd
    functions at TP > 1, the RNG tracker's fork for dropout and selective recomputation) runs eagerly between
    compiled pieces (graph breaks, not errors). Dropout in compiled code draws its masks from inductor's own
    generator: the same distribution, other masks than an eager run. The activation formula does not model
    what the compiled graphs save (the `activation memory` line says so). Where `trunk_compilable`, the model
    also compiles its trunk (embedding, the loop over the layers, final norm) as one region, into which these
    compiled forwards are inlined."""
    for layer in layers:
        layer.forward = torch.compile(layer.forward)


def trunk_compilable(config: GPTConfig, tp_size: int) -> bool:
    """Whether --torch-compile also compiles the model's trunk (embedding, all the layers, final norm) as one
    region: one compiled call per forward and one per backward instead of one per layer, and the embedding's and
    final norm's ops fused into it. Each call of a compiled region and each op launched outside one costs host
    time (guards, the autograd wrapper, dispatch) that a launch-bound GPU step waits for: a GPT-2-deep step at a
    width where the compute is negligible takes 12.5 ms of host time with the layers as one region against 15.4
    with twelve (bench/bench_host.py, 1 CPU thread; eager + torch.compile 11.1). Only where nothing in the trunk
    must run eagerly (`GPTConfig.trunk_eager_reason`): no recomputation (full recomputes chunks of layers in eager
    Python, selective forks the RNG tracker inside a layer), no activations in host memory, TP 1 (a layer's
    collectives would break the graph at every layer); ZeRO-3's gather and release hooks are checked at each
    forward (`has_module_hooks`)."""
    return config.trunk_eager_reason(tp_size) is None


def compile_trunk(trunk, cuda_graph_impl: str):
    """The trunk through torch.compile; with --cuda-graph-impl local, inductor's CUDA graph trees (torch.compile's
    "reduce-overhead" mode) capture its forward and backward and replay each as one launch, so the host no longer
    launches its kernels one by one (Megatron's --cuda-graph-impl local captures each layer's). A graph inductor
    cannot capture (an op CUDA graphs forbid, an input on the host) is an error naming it, not a silent fall back
    to launches. The parameters are the graphs' static inputs: ZeRO stages 0-2 keep them in place (a step writes
    the new values into the same storage); the tokens are copied into the graph's input at each replay. On a
    device other than CUDA inductor captures nothing and the trunk runs as without the option."""
    if cuda_graph_impl == "none":
        return torch.compile(trunk)
    return torch.compile(trunk, options={"triton.cudagraphs": True, "triton.cudagraph_or_error": True})


def has_module_hooks(modules: list[nn.Module]) -> bool:
    """Forward hooks on any of `modules` (ZeRO-3's gather and release): they run around their module, outside
    compiled code. (nn.Module has no public accessor for its hooks.)"""
    return any(module._forward_pre_hooks or module._forward_hooks for module in modules)
