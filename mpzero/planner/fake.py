"""mpzero's own code on tensors without data: shapes, dtypes and storages, no memory.

Two engines, the same patches, the same figures:
- "meta": tensors on torch's meta device (a factory call without a device lands there too). Every op is a C++
  shape function: about 25 us per op here. The device type reads "meta", which the code treats as the CPU
  except in one place: an offload tier's device<->host traffic is expected whenever the device is not "cpu".
- "fake": torch's `FakeTensorMode` (the approach torchtitan's estimator took): tensors report the CPU device, so
  every code path is the CPU's, offload tiers included (a parameter shard copied `.to("cpu")` stays fake). Every
  op goes through Python (about 250 us per op here), so a 175B-parameter step takes 10x longer.
The planner builds models on "meta"; the dry run (`mpzero/cli/dry_run.py`) uses "meta" unless a tier is offloaded.

What the code does that data-less tensors do not support as-is is handled here, only while the context is active:
- a scalar read from a tensor (`.item()`, `.tolist()`: the loss, the gradient norm with fp16's overflow check
  folded in) has no value: it reads 0 (no overflow, a zero norm: the step runs, nothing is clipped);
- (fake) a generator state saved for recomputation is cloned into a fake tensor, which has no bytes to restore:
  `torch.set_rng_state` of a fake state leaves the generator as it is (nothing draws real numbers here);
- (fake) `nn.Module.to(device)` of a module whose parameters are already fake tensors on that device (GPTEmbedding's
  position table) tries `torch.utils.swap_tensors` on the parameter, which fake tensors refuse: it is the identity
  there, as it is for real tensors already on the device;
- (meta) `torch.distributed.batch_isend_irecv` (a pipeline's point-to-point transfers) asks the process group for
  its backend on the tensors' device, and torch's fake backend registers none for meta: meta tensors' sends and
  receives are posted one by one, as torch itself posts them for a backend that does not coalesce (the fake
  backend takes `isend`/`irecv` of meta tensors; CPU and fake tensors keep the batched call);
- (meta) `F.scaled_dot_product_attention`: torch's kernel choice has no meta case and takes the math path (explicit
  [s, s] scores and probabilities saved for backward) where a CPU takes its flash kernel (the output and log-sum-exp
  saved): meta tensors without dropout and mask go to the op the CPU's dispatcher picks then (the one
  `mpzero.context_parallel.kernels` calls), with dropout or a mask to the math path as on a CPU. Without this the
  saved-tensor counter counted the math path's [s, s] tensors, which a CPU run does not keep (7,680 B more per
  layer of a 4-head model at s 16, b 2, fp32; with `auto` also resolved as an unknown device's local path, 16,128 B).
"""

from __future__ import annotations

import contextlib
from itertools import chain

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

ENGINES = ("meta", "fake")
_DEVICE = torch.ops.prim.device.default
_SCALAR = torch.ops.aten._local_scalar_dense.default


def _zero_of(dtype: torch.dtype):
    return False if dtype == torch.bool else 0.0 if dtype.is_floating_point or dtype.is_complex else 0


class _FakeMode(FakeTensorMode):
    """FakeTensorMode in which `.item()` returns 0 of the tensor's kind, with a fast path for device queries (the
    autograd engine asks one for every tensor it touches)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE and not self.in_kernel_invocation:
            return args[0].fake_device
        if func is _SCALAR:
            return _zero_of(args[0].dtype)
        return self.dispatch(func, types, args, kwargs)  # FakeTensorMode.__torch_dispatch__ minus its wrappers


_tensor_item = torch.Tensor.item
_tensor_tolist = torch.Tensor.tolist
_module_to = nn.Module.to
_set_rng_state = torch.set_rng_state
_batch_isend_irecv = dist.batch_isend_irecv
_sdpa = F.scaled_dot_product_attention
_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _item_or_zero(self: torch.Tensor):
    return _zero_of(self.dtype) if self.device.type == "meta" else _tensor_item(self)


def _tolist_or_zeros(self: torch.Tensor):
    if self.device.type != "meta":
        return _tensor_tolist(self)
    return _tensor_tolist(torch.zeros(self.shape, dtype=self.dtype, device="cpu"))


def _to_on_fake(self: nn.Module, *args, **kwargs):
    device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
    tensors = list(chain(self.parameters(), self.buffers()))
    if dtype is None and tensors and all(isinstance(t, FakeTensor) and (device is None or t.device == device)
                                         for t in tensors):
        return self
    return _module_to(self, *args, **kwargs)


def _set_rng_state_on_fake(new_state: torch.Tensor) -> None:
    if not isinstance(new_state, FakeTensor):
        _set_rng_state(new_state)


def _batch_isend_irecv_on_meta(p2p_op_list: list) -> list:
    if not p2p_op_list or p2p_op_list[0].tensor.device.type != "meta":
        return _batch_isend_irecv(p2p_op_list)
    works = [op.op(op.tensor, op.peer, group=op.group, tag=op.tag) for op in p2p_op_list]
    return [work for work in works if work]


def _sdpa_as_on_a_cpu(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False):
    if query.device.type != "meta" or attn_mask is not None or dropout_p > 0:
        return _sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                     enable_gqa=enable_gqa)
    return _CPU_FLASH(query, key, value, 0.0, is_causal, scale=scale)[0]  # grouped K/V taken as they are


def engine_device(engine: str) -> torch.device:
    """The device the code is handed under `engine`: tensors are created there."""
    return torch.device("meta" if engine == "meta" else "cpu")


@contextlib.contextmanager
def no_data(engine: str = "meta"):
    """Every tensor made inside has no data (see the module docstring). Not re-entrant, not thread-safe: it
    patches torch functions for its duration."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is not one of {ENGINES}")
    try:
        if engine == "meta":
            torch.Tensor.item, torch.Tensor.tolist = _item_or_zero, _tolist_or_zeros
            dist.batch_isend_irecv, F.scaled_dot_product_attention = _batch_isend_irecv_on_meta, _sdpa_as_on_a_cpu
            with torch.device("meta"):
                yield
        else:
            nn.Module.to, torch.set_rng_state = _to_on_fake, _set_rng_state_on_fake
            with _FakeMode(allow_non_fake_inputs=True):
                yield
    finally:
        torch.Tensor.item, torch.Tensor.tolist = _tensor_item, _tensor_tolist
        nn.Module.to, torch.set_rng_state = _module_to, _set_rng_state
        dist.batch_isend_irecv, F.scaled_dot_product_attention = _batch_isend_irecv, _sdpa


def fake_tensors():
    """`no_data("fake")`."""
    return no_data("fake")
