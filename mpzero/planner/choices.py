"""What a layout may choose, given the model and the machine: the pipeline schedules to try, whether context
parallelism can split the sequence, the offload tiers a ZeRO stage takes, a mixture of experts' EP and expert-TP
sizes (`Planner.layouts` enumerates their products)."""

from __future__ import annotations


def expert_grids(model, tp: int, eps, expert_tps) -> list[tuple[int, int | None]]:
    """(EP, expert-TP or None for TP) to try: a dense model (1, None); experts: each EP in `eps` (default every
    divisor of the expert count) with expert-TP TP and, at TP > 1, 1 (or `expert_tps`; 0 stands for TP). What the
    world does not fold is left to `Layout.apply`'s checks."""
    if not model.num_experts:
        return [(1, None)]
    sizes = [e for e in (eps or range(1, model.num_experts + 1)) if model.num_experts % e == 0]
    tps = expert_tps if expert_tps is not None else ((0, 1) if tp > 1 else (0,))
    return [(e, None if t in (0, tp) else t) for e in sizes for t in dict.fromkeys(tps)]


def schedules(pp: int, virtual, zero_bubble) -> list[tuple[int, bool]]:
    """(virtual stages, zero bubble) to try with `pp` stages."""
    if pp == 1:
        return [(1, False)]
    out = [(1, False)] + [(v, False) for v in (virtual if virtual is not None else (2,)) if v > 1]
    return out + ([(1, True)] if True in (zero_bubble if zero_bubble is not None else (False, True)) else [])


def context_fits(model, seq: int, tp: int, cp: int) -> bool:
    """Whether CP `cp` can split this run: 2·CP chunks of the sequence; a2a's heads and groups per TP rank."""
    if cp == 1:
        return True
    heads, groups = model.num_attention_heads // tp, model.query_groups // tp
    return seq % (2 * cp) == 0 and (model.cp_comm_type != "a2a" or (heads % cp == 0 and groups % cp == 0))


def offloads(stage: int, tiers) -> list[tuple[str, str]]:
    pairs = [("none", "none")]
    if stage >= 1:
        pairs += [(o, "none") for o in tiers if o != "none"]
    if stage == 3:
        pairs += [(o, p) for o in tiers if o != "none" for p in tiers if p != "none"]
    return pairs
