"""zero_memory, a part of `make gpu-check`: the `zero memory` line (bytes counted from the tensors a rank holds, and
their formula) against what the CUDA allocator says, at ZeRO stages 0-3 for GPT-2 124M in bf16 on one GPU, the
model built as pretrain_gpt builds it (on the meta device, then streamed into each rank's shard by the optimizer),
so the line's construction peak is checked against the allocator's peak too."""

from __future__ import annotations

from tests.gpu.check.gpt2_step import GPT2_124M, free_cuda, gpt_config
from tests.gpu.check.result import Result, error_text


def zero_memory(args, result: Result) -> str:
    import torch
    from mpzero.models import GPTModel
    from mpzero.parallel import init_parallel
    from mpzero.tensor_parallel import seed_everything
    from mpzero.zero import ZeroOptimizer
    from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig

    groups = init_parallel(1)
    shape, batch = GPT2_124M, 4
    seq = shape.seq_length
    config = gpt_config(shape, use_flash_attn=True)
    tokens = torch.randint(0, shape.vocab_size, (batch, seq + 1), device=groups.device)
    result.note("GPT-2 124M, bf16 (fp32 masters and gradients), world of one (N = 1), flash attention. "
                "'counted' = the zero memory line's measured bytes (unique storages held by the stage and the "
                "master store); 'allocated' = torch.cuda.memory_allocated after the optimizer is built (model "
                "made on the meta device and streamed onto the GPU by the optimizer, as pretrain_gpt does); "
                "'construction formula' = the line's construction peak formula (the states + one bucket's or "
                "unit's working set); 'peak build' = max_memory_allocated while building; "
                f"'peak step' = max_memory_allocated through one training step at micro-batch {batch} x {seq}. "
                "ok: counted within 1% of the formula, allocated within 2% + 32 MiB of counted, and peak build at "
                "most the construction formula + 2% + 32 MiB")
    ok = True
    for stage in (0, 1, 2, 3):
        model = opt = None
        try:
            free_cuda()
            base = torch.cuda.memory_allocated()
            model = GPTModel(config, groups.tp, seed_everything(1234, 0, groups.device), device="meta")
            opt = ZeroOptimizer(model, groups, ZeroConfig(stage=stage), AdamConfig(lr=1e-4),
                                PrecisionConfig("bf16"))
            torch.cuda.synchronize()
            allocated = torch.cuda.memory_allocated() - base
            peak_build = torch.cuda.max_memory_allocated() - base
            line = opt.memory_report()
            print(line.line(), flush=True)
            opt.zero_grad()
            loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
            opt.backward(loss, last_micro_batch=True)
            opt.step(1e-4)
            torch.cuda.synchronize()
            peak_step = torch.cuda.max_memory_allocated() - base
            construction = line.construction[0]  # "construction peak": counted states + working set
            good = (abs(line.measured / line.formula - 1) <= 0.01
                    and abs(allocated - line.measured) <= 0.02 * line.measured + 32 * 2 ** 20
                    and peak_build <= 1.02 * construction.formula + 32 * 2 ** 20)
            mib = 2 ** 20
            result.row(stage=stage, params=line.numel, formula=line.formula_text,
                       **{"formula MiB": round(line.formula / mib, 1), "counted MiB": round(line.measured / mib, 1),
                          "allocated MiB": round(allocated / mib, 1),
                          "allocated / formula": round(allocated / line.formula, 4),
                          "construction formula MiB": round(construction.formula / mib, 1),
                          "peak build MiB": round(peak_build / mib, 1),
                          "peak build / construction formula": round(peak_build / construction.formula, 4),
                          "peak step MiB": round(peak_step / mib, 1)},
                       ok=good)
            ok = ok and good
        except Exception as error:  # noqa: BLE001
            result.row(stage=stage, ok=False, note=error_text(error))
            ok = False
        finally:
            del model, opt
            free_cuda()
    return "pass" if ok else "fail"
