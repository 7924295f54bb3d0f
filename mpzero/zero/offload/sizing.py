"""The offloaded optimizer's host buffers, sized from the settings alone: the sub-group one buffer holds and the
bytes (and formula text) of all of them, for `OffloadedMasters` (masters.py), which allocates them, and for the
memory planner, which predicts them without building anything.
"""

from __future__ import annotations

from mpzero.optim import UpdateRule
from mpzero.zero.config import OffloadConfig
from mpzero.zero.offload.swap import ALIGN, round_up


def stored_states(rule: UpdateRule) -> tuple[str, ...]:
    """One file per state on disk, in this order in every buffer: the master, then the rule's states."""
    return ("master",) + rule.state_names


def _scratch_bytes(rule: UpdateRule) -> int:
    """The scratch block: parameter, gradient and the rule's states of one grid block, fp32."""
    return 4 * (2 + len(rule.state_names)) * rule.block


def group_numel(offload: OffloadConfig, numel: int) -> int:
    """Elements per buffer: a sub-group, never more than the partition, rounded up to whole 4096-byte blocks
    (so the last sub-group's O_DIRECT window fits)."""
    return round_to_block(min(offload.sub_group_numel, max(numel, 1)))


def round_to_block(numel: int) -> int:
    per_block = ALIGN // 4
    return -(-numel // per_block) * per_block


def buffer_bytes(offload: OffloadConfig, numel: int, cuda: bool, param_bytes: int, rule: UpdateRule,
                 staged_grads: bool = True) -> int:
    """Host bytes `OffloadedMasters` allocates for buffers over a partition of `numel` elements (exactly: each
    buffer's storage, alignment slack included; the pinned allocator may round the reservation further).
    G = min(sub_group_numel, numel) rounded up to 1024 elements; each buffer is aligned_bytes(G, dtype):
      disk tier: buffer_count x S states x fp32 (S = 1 + the rule's states);  CUDA: 2 pinned fp32 gradient
      staging buffers (not when the gradients are streamed to the host in backward, `staged_grads=False`);
      always: 1 parameter staging buffer in the model's dtype, and a (S + 1) x 256 fp32 scratch."""
    g = group_numel(offload, numel)
    fp32 = round_up(4 * g) + ALIGN  # = aligned_bytes(g, torch.float32)
    total = round_up(param_bytes * g) + ALIGN + _scratch_bytes(rule)
    if offload.optimizer == "disk":
        total += offload.buffer_count * len(stored_states(rule)) * fp32
    if cuda and staged_grads:
        total += 2 * fp32
    return total


def buffer_formula(offload: OffloadConfig, numel: int, cuda: bool, param_bytes: int, rule: UpdateRule,
                   staged_grads: bool) -> tuple[int, str]:
    """(bytes, text) of `OffloadedMasters.host_buffer_formula`: G-element buffers (G: see buffer_bytes), each + 4 KiB
    of alignment, + the scratch; the text has no spaces (the memory line's fields are "name value")."""
    o, p = offload, param_bytes
    per_g, buffers = p, 1  # the parameter staging buffer
    if o.optimizer == "disk":
        files = o.buffer_count * len(stored_states(rule))  # a buffer per state, per pipeline slot
        per_g, buffers = per_g + files * 4, buffers + files
    if cuda and staged_grads:
        per_g, buffers = per_g + 2 * 4, buffers + 2
    scratch = _scratch_bytes(rule)  # AdamW's is 4 KiB: counted with the alignment slack
    blocks = f"{buffers + 1}x4KiB" if scratch == ALIGN else f"{buffers}x4KiB+{scratch}B"
    text = f"{per_g}G+{blocks}(G={group_numel(o, numel)})"
    return buffer_bytes(o, numel, cuda, p, rule, staged_grads), text
