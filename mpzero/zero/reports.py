"""The ZeRO optimizer's own accounting: the model-state bytes this rank holds and the bytes it moves per
iteration (DP collectives, offload tier transfers), each against its formula (accounting.py). `ZeroOptimizer`
takes `memory_report`, `comm_report` and `uncounted` from the mixin here.
"""

from __future__ import annotations

import dataclasses

from mpzero.storages import unique_storage_bytes
from mpzero.zero.accounting import (CommReport, MemoryReport, PeakReport, TierReport, TransferReport, comm_theory,
                                   memory_report, offload_formula, offload_tiers, transfer_theory)
from mpzero.zero.families import family_stages
from mpzero.zero.tiers import Transfers


class OptimizerReports:
    """Memory and communication reports of an optimizer front. A mixin: the class using it has `stage` (a
    `ZeroStage`), `masters` (a `MasterStore`), `groups`, `zero`, `offload`, `precision`, `rule`, `numel`,
    `iteration`, `_last_micro_batches` (of the last step) and `_construction_formula` (construction.py's working
    set), `families` (zero/families.py), and calls `_start_counting()` once built; the marks the communication
    report counts from are its own."""

    def _start_counting(self) -> None:
        """The marks the next `comm_report` counts from: the DP bytes counted so far, tier transfers from zero."""
        self._comm_mark = (self._counted_bytes(), 0)  # (bytes counted, iteration) at the last report
        self._transfer_mark = Transfers()

    def _counted_bytes(self) -> float:
        """Bytes counted on the groups the families reduce over (DP x CP; the expert-DP group too)."""
        return sum(group.stats.total() for group in {id(f.group): f.group for f in self.families}.values())

    def _expert(self) -> tuple[int, int] | None:
        """(Pe, Ne) of the expert family, None without one (zero/families.py)."""
        expert = next((f for f in self.families if f.name == "expert"), None)
        return None if expert is None else (expert.numel, expert.group.size)

    @property
    def _dense_numel(self) -> int:
        return sum(f.numel for f in self.families if f.name == "dense")

    def memory_report(self) -> MemoryReport:
        """Model-state bytes this rank holds (unique storages, padding included) against the formula."""
        held = self.stage.held_tensors() + self.masters.held_tensors()
        p, g = self._element_sizes()
        master = self.masters.master_bytes_per_param
        padding = sum(layout.padding for layout in self.stage.layouts)
        tiers = self._tiers()
        offloaded = tuple(component for component, tier in tiers.items() if tier != "none")
        report = memory_report(self.zero.stage, self.groups.dp_size, self._dense_numel, unique_storage_bytes(held),
                               padding, p, g, master, self.rule.state_bytes_per_param, offloaded, self._expert())
        if offloaded:
            report = dataclasses.replace(report, tiers=self._tier_reports(tiers, p, g))
        meters, formula = self.stage.construction, self._construction_formula
        report = dataclasses.replace(report, construction=(
            TierReport("construction peak", report.measured + meters.device.peak, report.formula + formula.device,
                       f"{report.formula_text}+{formula.device_text}"),
            TierReport("construction host working set", meters.host.peak, formula.host, formula.host_text)))
        working = self.stage.peak_working_set(p, g)
        if working is not None and self.stage.meter.peak:  # after a step: its high-water mark
            working_set, text = working
            report = dataclasses.replace(report, peak=PeakReport(
                report.measured + self.stage.meter.peak, report.formula + working_set,
                text if report.formula == 0 else f"{report.formula_text}+{text}"))
        return report

    def comm_report(self) -> CommReport:
        """Bytes per rank per iteration counted on the DP group since the last report, against theory."""
        total, (mark_bytes, mark_iteration) = self._counted_bytes(), self._comm_mark
        iterations = max(self.iteration - mark_iteration, 1)
        self._comm_mark = (total, self.iteration)
        p, g = self._element_sizes()
        regathered = {family.name: stage.regathered_numel() for family, stage in zip(self.families, family_stages(
            self.stage))}  # X and Xe, each family's stage 3 third gathers
        dense = {family.name: stage for family, stage in zip(self.families, family_stages(self.stage))}.get("dense")
        fp8_gather = getattr(dense, "fp8_gather_terms", lambda: None)()  # stage 3's --fp8-param-gather
        theory, text = comm_theory(self.zero.stage, self.groups.dp_size, self._dense_numel, p, g,
                                   self._last_micro_batches, regathered.get("dense", 0), self._expert(),
                                   regathered.get("expert", 0), fp8_gather)
        transfers = ()
        tiers = self._tiers()
        if any(tier != "none" for tier in tiers.values()):
            moved, self._transfer_mark = self._transfers() - self._transfer_mark, self._transfers()
            expected = transfer_theory(p, self._dense_numel, self.groups.dp_size, self._last_micro_batches, tiers,
                                       device_is_host=self.groups.device.type == "cpu",
                                       states=self.rule.state_bytes_per_param, g=g, expert=self._expert())
            counted = {"device-to-host": moved.device_to_host, "host-to-device": moved.host_to_device,
                       "disk-read": moved.disk_read, "disk-written": moved.disk_written}
            transfers = tuple(TransferReport(name, counted[name] / iterations, *expected[name]) for name in counted)
        return CommReport(self.zero.stage, self.groups.dp_size, self._last_micro_batches,
                          (total - mark_bytes) / iterations, theory, text, transfers)

    # -- offload accounting -----------------------------------------------------------------------
    def _element_sizes(self) -> tuple[int, int]:
        """(p, g): bytes per parameter and per gradient element in the model's precision."""
        return self.precision.torch_dtype.itemsize, self.precision.grad_dtype.itemsize

    def _tiers(self) -> dict[str, str]:
        return offload_tiers(self.zero.stage, self.offload)

    def _transfers(self) -> Transfers:
        return self.stage.transfers() + self.masters.transfers()

    def _tier_reports(self, tiers: dict[str, str], p: int, g: int) -> tuple[TierReport, ...]:
        """Host and disk bytes against offload_formula, and the bounded buffers against their own formula."""
        held = self.stage.tier_bytes() + self.masters.tier_bytes()
        per_param = offload_formula(self.zero.stage, p, g, tiers, self.rule.state_bytes_per_param)
        measured = {"host": held.host, "disk": held.disk}
        expert = self._expert()
        partition = self._dense_numel / self.groups.dp_size + (expert[0] / expert[1] if expert else 0)
        reports = [TierReport(name, measured[name], coef * partition,
                              f"{coef}P/N" + (f"+{coef}Pe/Ne" if expert else "")) for name, coef in per_param.items()]
        buffers, text = self.masters.host_buffer_formula()
        stage_buffers, stage_text = self.stage.host_buffer_formula()
        reports.append(TierReport("host buffers", held.host_buffers, buffers + stage_buffers,
                                  "+".join(t for t in (text, stage_text) if t != "0") or "0"))
        return tuple(reports)

    def uncounted(self, fn, *args):
        """fn(*args), with its DP bytes and tier transfers left out of the next `comm_report`, which states a
        training iteration's: an evaluation's stage-3 gathers, an export's or a load's collectives."""
        before, moved = self._counted_bytes(), self._transfers()
        result = fn(*args)
        mark_bytes, mark_iteration = self._comm_mark
        self._comm_mark = (mark_bytes + self._counted_bytes() - before, mark_iteration)
        self._transfer_mark = self._transfer_mark + (self._transfers() - moved)
        return result
