"""Where one training step's time goes: torch.profiler over one call of `step`, as (ops launched, the per-op
table by self time). Ops are CUDA kernels on a GPU (a launch-bound GPU pays per kernel) and leaf aten ops on a
CPU (a compiled region's fused C++ kernels are no aten ops and are not counted there). Shared by
`bench/bench_step.py --profile` and `make gpu-check`'s bench_gpt2 part."""

from __future__ import annotations


def step_profile(step, *inputs, cuda: bool | None = None, rows: int = 25) -> tuple[int, str]:
    """`step(*inputs)` profiled once; `cuda`: the step runs on a GPU (default: any input is a CUDA tensor)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if cuda is None:
        cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step(*inputs)
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    if cuda:
        ops = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    else:
        ops = sum(1 for e in events if e.name.startswith("aten::")
                  and not any(c.name.startswith("aten::") for c in e.cpu_children))
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return ops, prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=50)
