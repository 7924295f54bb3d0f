"""The baselines and the profiler the GPU benchmarks share: nanoGPT's eager GPT-2 (what mpzero's step is measured
against) and `step_profile`, where one training step's time goes. Used by `bench/bench_step.py` (a sibling module
of the script) and by `make gpu-check`'s bench_gpt2 part (`bench.baselines`, the repository root on PYTHONPATH).
torch is imported inside each function, so importing this module costs nothing."""

from __future__ import annotations

from dataclasses import dataclass


def eager_gpt2(vocab: int, h: int, layers: int, heads: int, seq: int):
    """nanoGPT's GPT-2: pre-LN blocks, F.scaled_dot_product_attention, GELU MLP, tied output projection."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
            q, k, v = (t.view(b, s, heads, h // heads).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
            x = x + self.proj(y)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(h)
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, std=0.02)

        def forward(self, tokens, labels):
            x = self.wte(tokens) + self.wpe(torch.arange(tokens.size(1), device=tokens.device))
            for block in self.blocks:
                x = block(x)
            logits = F.linear(self.ln_f(x), self.wte.weight)
            return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.reshape(-1))

    return GPT()


@dataclass(frozen=True)
class StepProfile:
    """One training step under torch.profiler."""
    ops: int  # CUDA kernels launched (on a GPU) or leaf aten ops dispatched (on a CPU)
    table: str  # the per-op table by self time
    kernel_ms: float | None  # the kernels' summed time (a GPU); with one stream, the time the GPU was busy
    launches: int | None = None  # a GPU: the host's launch calls (kernels, memcpy/memset, CUDA graphs)
    graph_launches: int | None = None  # a GPU: the CUDA graphs among them (each replays many kernels)


# The CUDA runtime and driver calls by which the host starts work on the GPU (Triton launches through the driver)
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                "cudaMemcpyAsync", "cudaMemsetAsync")


def step_profile(step, *inputs, cuda: bool | None = None, rows: int = 25) -> StepProfile:
    """Where one training step's time goes: torch.profiler over one call of `step`. Ops are CUDA kernels on a GPU
    and leaf aten ops on a CPU (a compiled region's fused C++ kernels are no aten ops and are not counted there).
    `step(*inputs)` profiled once; `cuda`: the step runs on a GPU (default: any input is a CUDA tensor). The kernels'
    time against the step's wall time says how long the GPU waited for the host."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if cuda is None:
        cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step(*inputs)
        if cuda:
            torch.cuda.synchronize()
    events, kernel_ms, launches, graph_launches = prof.events(), None, None, None
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        ops, kernel_ms = len(kernels), sum(e.self_device_time_total for e in kernels) / 1000
        calls = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name in LAUNCH_CALLS]
        launches, graph_launches = len(calls), calls.count("cudaGraphLaunch")
    else:
        ops = sum(1 for e in events if e.name.startswith("aten::")
                  and not any(c.name.startswith("aten::") for c in e.cpu_children))
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return StepProfile(ops, prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=50),
                       kernel_ms, launches, graph_launches)
