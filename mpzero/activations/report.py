"""The `activation memory` lines: counted bytes beside the formula, one line per rank, printed by the logging
rank after the first iteration (the counter watched its first micro-batch's forward), and TensorBoard scalars.

    activation memory rank 1 | selective recomputation, TP 2, bf16, s 16 b 2 h 32 a 4 | layers 0-1 (selective)
    39,808 B counted, formula 39,808 B = sbh(10 + 24/t) = 20,480 + LayerNorm inputs kept in fp32 4sbh = 4,096 + ...,
    ratio 1.0000 | micro-batch 121,800 B counted, formula 121,800 B, ratio 1.0000 | layer vs stored 1.04x

A model gives its formula through `activation_setting(micro_batch_size, seq_length, dtype, device)` (the GPT
does); without one, or where the formula does not model the setting, the line gives the counted bytes alone.
"""

from __future__ import annotations

import torch

from mpzero.activations.count import COMPILED_TRUNK, SavedBytesCounter
from mpzero.activations.formula import ActivationSetting, activation_formula, exchange_term, mode_name, modeled

_DTYPE_NAMES = {4: "fp32", 2: "16-bit"}


def rank_report(counter: SavedBytesCounter, setting: ActivationSetting | None, in_flight=None) -> dict:
    """This rank's counted bytes and its formula (picklable, for gathering to the logging rank). `in_flight`: a
    pipeline stage's micro-batches held at once, counted against the schedule's formula (an object whose
    `text()` the line ends with: `mpzero.pipeline.in_flight`), or None."""
    why = "the model gives no activation_setting" if setting is None else modeled(setting)
    formula = activation_formula(setting, _expert_rows(counter)) if why is None else None
    indices = range(max([k for k in counter.device_bytes if isinstance(k, int)], default=-1) + 1)
    if setting is not None:
        indices = setting.layer_indices  # a pipeline stage's layers, by global index
    return {"layers": [counter.device_bytes.get(i, 0) for i in indices], "indices": tuple(indices),
            "compiled trunk": counter.device_bytes.get(COMPILED_TRUNK, 0),
            "outside": counter.device_bytes.get(None, 0),
            "total": counter.total_bytes, "host": sum(counter.host_bytes.values()), "formula": formula,
            "why": why, "setting": setting, "exchange": counter.exchange_peak,
            "exchange_formula": exchange_term(setting) if setting is not None else None, "in flight": in_flight}


def _expert_rows(counter: SavedBytesCounter) -> dict:
    """{layer: rows its experts received} as the counter saw them (mixture-of-experts layers only)."""
    return {k: v for k, v in counter.expert_rows.items() if isinstance(k, int)}


def _ratio(counted: int, formula: int) -> str:
    return f"{counted / formula:.4f}" if formula else ("1.0000" if counted == 0 else "inf")


def _ranges(indices: list[int]) -> str:
    parts, start = [], None
    for k, i in enumerate(indices):
        if start is None:
            start = i
        if k + 1 == len(indices) or indices[k + 1] != i + 1:
            parts.append(f"{start}" if start == i else f"{start}-{i}")
            start = None
    return ",".join(parts)


def activation_line(rank: int, report: dict, dtype: torch.dtype | None = None) -> str:
    setting, formula = report["setting"], report["formula"]
    head = f"activation memory rank {rank}"
    if setting is not None:
        dtype_name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
        head += (f" | {mode_name(setting)}, TP {setting.tp}, {dtype_name}, s {setting.seq_length}"
                 f"{' per CP rank' if setting.cp > 1 else ''} "
                 f"b {setting.micro_batch_size} h {setting.hidden_size} a {setting.num_attention_heads}")
    parts = [head]
    counted = report["layers"]
    if formula is None:
        if report.get("compiled trunk"):  # one compiled region: its saved tensors are not the layers' own
            parts.append(f"embedding, layers {_ranges(list(report['indices']))} and final norm (one compiled "
                         f"region) {report['compiled trunk']:,} B counted")
        else:
            parts.append(f"layers {', '.join(f'{c:,}' for c in counted)} B counted")
        parts.append(f"micro-batch {report['total']:,} B counted (no formula: {report['why']})")
        return " | ".join(parts + _in_flight(report))
    groups: dict = {}
    for i, layer in enumerate(formula.layers):  # a MoE layer's rows are its own: one group each
        groups.setdefault((layer.kind, layer.host, i if layer.rows is not None else None), []).append(i)
    for (kind, host, _), positions in groups.items():
        layer = formula.layers[positions[0]]
        seen = sorted({counted[i] for i in positions})
        shown = f"{seen[0]:,}" if len(seen) == 1 else "/".join(f"{c:,}" for c in seen)
        where = " on the host" if host else ""
        indices = [formula.indices[i] for i in positions]
        text = f"layers {_ranges(indices)} ({kind}{where}) {shown} B counted, formula {layer.device_bytes:,} B"
        if layer.device_bytes:
            text += f" = {layer.text()}, ratio {_ratio(max(seen), layer.device_bytes)}"
        parts.append(text + _rows_text(setting, layer))
    worst = formula.worst_case_bytes
    parts.append(f"micro-batch {report['total']:,} B counted, formula {formula.micro_batch_bytes:,} B (outside the "
                 f"layers {formula.outside_bytes:,}), ratio {_ratio(report['total'], formula.micro_batch_bytes)}"
                 + (f", {_bound(setting)} {worst:,} B" if worst != formula.micro_batch_bytes else ""))
    if report["host"] or setting.offload_activations:
        host = [layer.host_bytes for layer in formula.layers]
        host_formula = "not modeled (save_on_cpu copies every saved tensor)" if None in host else f"{sum(host):,} B"
        parts.append(f"host {report['host']:,} B counted, formula {host_formula}")
    exchange = report.get("exchange_formula")
    if exchange is not None:
        parts.append(f"attending {report['exchange']:,} B counted, formula {exchange.bytes:,} B = {exchange.name} "
                     f"{exchange.text}, ratio {_ratio(report['exchange'], exchange.bytes)}")
    stored = formula.stored_layer_bytes
    if setting.recompute_granularity is not None and stored and counted:
        parts.append(f"layers vs stored {sum(counted) / (stored * len(counted)):.2f}x")
    return " | ".join(parts + _in_flight(report))


def _bound(setting: ActivationSetting) -> str:
    capped = setting.moe is not None and setting.moe.capacity_factor is not None
    return "worst case at capacity" if capped else "dropless worst case"


def _rows_text(setting: ActivationSetting, layer) -> str:
    """A mixture-of-experts layer's counted rows and its worst case (nothing for another layer)."""
    if layer.rows is None:
        return ""
    return (f" (mixture of experts at R {layer.rows:,} rows counted into this rank's experts; {_bound(setting)} "
            f"R {layer.worst_rows:,}: {layer.worst_bytes:,} B)")


def _in_flight(report: dict) -> list[str]:
    held = report.get("in flight")
    return [] if held is None else [held.text()]


def report_activation_memory(counter: SavedBytesCounter, model, groups, micro_batch_size: int, seq_length: int,
                             dtype: torch.dtype, tensorboard=None, iteration: int = 0, in_flight=None) -> list[dict]:
    """Gather every rank's report (a collective: every rank calls it), print one line per rank on the logging
    rank, and give TensorBoard each rank's counted and formula bytes. Returns the reports, in world-rank order.
    `in_flight(counter, formula)`: a pipeline stage's held micro-batches (`rank_report`), or None."""
    setting_of = getattr(model, "activation_setting", None)
    setting = setting_of(micro_batch_size, seq_length, dtype, groups.device) if setting_of else None
    why = "no setting" if setting is None else modeled(setting)
    held = None
    if in_flight is not None:
        held = in_flight(counter, activation_formula(setting, _expert_rows(counter)) if why is None else None)
    reports = groups.world.all_gather_objects(rank_report(counter, setting, held))
    if groups.is_logging_rank:
        for rank, report in enumerate(reports):
            print(activation_line(rank, report, dtype), flush=True)
    if tensorboard is not None:
        scalars = {}
        for rank, report in enumerate(reports):
            scalars[f"activations/rank-{rank}-layers-bytes"] = sum(report["layers"]) + report["compiled trunk"]
            scalars[f"activations/rank-{rank}-micro-batch-bytes"] = report["total"]
            if report["formula"] is not None:
                scalars[f"activations/rank-{rank}-layers-formula-bytes"] = sum(report["formula"].layer_bytes)
                scalars[f"activations/rank-{rank}-micro-batch-formula-bytes"] = report["formula"].micro_batch_bytes
        tensorboard.scalars(scalars, iteration)
    return reports
