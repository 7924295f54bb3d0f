"""What an elementwise update rule is: the one value ZeRO's master stores, the offload tiers, checkpoints,
accounting and the planner read about the optimizer.

A rule updates an fp32 master slice in place from a gradient slice and its own per-element fp32 states
(`state_names`, e.g. AdamW's exp_avg and exp_avg_sq), optionally writing the model's low-precision copy.
Because the update is elementwise, any partition of the elements (ZeRO's 1/N slices, an offload tier's
sub-groups) gives the single-process result bit for bit, provided each element takes the same code path:
`windows` cuts a call the way that guarantees it (see `canonical_windows`).

Everything else follows from `state_names`: the optimizer-state bytes per parameter are
K = master + 4 x len(state_names) (master 4 in mixed precision, 0 when the fp32 parameter is the master),
the disk tier keeps one file per state, checkpoints store optimizer/<state>/<name>.
"""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

BLOCK = 256  # canonical grid: a multiple of every CPU SIMD width (fp32: 8 on AVX2, 16 on AVX-512)


def canonical_windows(run_start: int, run_end: int, lo: int, hi: int, block: int = BLOCK) -> list[tuple[int, int]]:
    """The calls that update elements [lo, hi) of the decay run [run_start, run_end) exactly as one call
    over the whole run does.

    Why: a vectorized CPU kernel runs its SIMD body over floor(n / VEC) * VEC elements of a call and a scalar
    tail over the rest, and the two can differ in the last bit. Cut the run on a grid of `block` elements
    anchored at run_start (block a multiple of VEC). A call over whole grid blocks is all SIMD, as the run-wide
    call is there; the run's last partial block, L = (run_end - run_start) % block elements, called alone has
    the run-wide call's SIMD part and tail. So each returned window [a, b) is either
      - inside [lo, hi): update it in place, one call; or
      - one grid block that [lo, hi) covers in part (lo or hi cuts it): update a scratch copy of the whole block,
        the wanted elements at their offsets and zeros elsewhere, and keep only [max(a, lo), min(b, hi)).
    A cut costs at most one scratch block on each side of it (< 2 * block elements per sub-group boundary).
    """
    assert run_start <= lo < hi <= run_end, (run_start, lo, hi, run_end)
    windows, x = [], lo
    while x < hi:
        start = run_start + (x - run_start) // block * block  # the grid block holding x
        end = min(start + block, run_end)
        if x != start or end > hi:  # the block is cut: scratch
            windows.append((start, end))
            x = min(end, hi)
        elif end - start == block:  # whole blocks, as many as lie in [x, hi): one call
            last = run_start + (hi - run_start) // block * block
            windows.append((x, last))
            x = last
        else:  # the run's last, partial block, whole in [lo, hi)
            windows.append((start, end))
            x = end
    return windows


class UpdateRule(ABC):
    """An elementwise optimizer rule and its own hyperparameters (a frozen dataclass in each rule module).

    name: the --optimizer value, recorded in checkpoints; state_names: its fp32 per-element states beside the
    master, in a fixed order (offload buffers, files and checkpoint keys follow it)."""

    name: ClassVar[str]
    state_names: ClassVar[tuple[str, ...]]
    block: ClassVar[int] = BLOCK  # the canonical grid of `windows`

    @property
    def state_bytes_per_param(self) -> int:
        """Bytes of optimizer state per parameter beside the master (all states are fp32)."""
        return 4 * len(self.state_names)

    @abstractmethod
    def validate(self) -> None:
        """A ConfigError (one line, naming the flag) for a hyperparameter out of range; never mutates."""

    @abstractmethod
    def resolve_impl(self, device: torch.device | str, impl: str) -> str:
        """The implementation `step` runs on `device` for the requested `impl` ("auto", "torch", ...)."""

    @abstractmethod
    def step(self, master: torch.Tensor, grad: torch.Tensor, states: dict[str, torch.Tensor], *, lr: float,
             weight_decay: float, step: int, impl: str, model_copy: torch.Tensor | None = None) -> None:
        """Step `step` (from 1) in place over one flat fp32 slice: `master` and `states[name]` are contiguous
        fp32 tensors of one length, `grad` fp32/bf16/fp16 of it; `model_copy` (optional) receives the new
        values in the model's dtype."""

    def folds_grad_scale(self, impl: str) -> bool:
        """Whether `step(..., grad_scale=c)` multiplies the gradient by c within its own pass (implementation
        `impl`), so the step makes no pass over the gradients to clip them. Otherwise the store scales them in place
        first and calls `step` without it (a rule need not know the keyword)."""
        return False

    def skips_on_device(self, impl: str) -> bool:
        """Whether `step(..., skip=flag)` takes a 0-dim device flag (and a device `grad_scale`) and writes nothing
        when it is set, so a step can be launched before the host knows the gradient norm (issue 46)."""
        return False

    def skips_with_device_scalars(self, impl: str) -> bool:
        """Whether `masked_scalars` and `step_masked` exist for `impl`: fp16's launched step, whose learning rate
        and step count the device picks (mpzero/fused/adam_scalars.py)."""
        return False

    def windows(self, run_start: int, run_end: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """The canonical decomposition for offload exactness (see `canonical_windows`)."""
        return canonical_windows(run_start, run_end, lo, hi, self.block)

    # -- the command line: each rule owns its flags -------------------------------------------------
    flag_ranges: ClassVar[dict] = {}  # dest: (lowest, lowest allowed?, highest, highest allowed?), as flag_ranges

    @staticmethod
    @abstractmethod
    def add_flags(group: argparse._ArgumentGroup) -> None:
        """Add this rule's hyperparameter flags (Megatron's names) to the parser's group."""

    @classmethod
    @abstractmethod
    def from_args(cls, args: argparse.Namespace) -> UpdateRule:
        """The rule with the hyperparameters the parsed flags give."""
