"""Named RNG streams for dropout under tensor parallelism, and activation recomputation that replays them.

Dropout on replicated activations (hidden dropout) must draw the same mask on every TP rank, so it uses
the default generator, seeded identically. Dropout on sharded activations (attention probabilities of this
rank's heads) must differ across TP ranks, so it runs inside `tracker.fork()`, a stream seeded with
seed + 2718 + tp_rank as in Megatron. Recomputation saves and restores both, so replayed masks are identical;
under sequence parallelism hidden dropout draws from the tensor-parallel stream too (each rank holds another
slice of the sequence). `recompute(..., distribute=tp)` keeps the checkpoint as 1/t slices (ZeRO-R's Pa).
"""

from __future__ import annotations

import contextlib

import torch


def _get_rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _fresh_state(device: torch.device, seed: int) -> torch.Tensor:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator.get_state()


class RNGStatesTracker:
    """Named generator states swapped into the device's default generator by `fork(name)`."""

    TENSOR_PARALLEL = "tensor-parallel"

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} already exists")
        self.states[name] = _fresh_state(self.device, seed)

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL):
        outside = _get_rng_state(self.device)
        _set_rng_state(self.device, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_rng_state(self.device)
            _set_rng_state(self.device, outside)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    def snapshot(self) -> dict:
        """Everything dropout draws from on this rank: the default generator and the named streams."""
        return {"default": _get_rng_state(self.device), "streams": self.get_states()}

    def restore(self, snapshot: dict) -> None:
        _set_rng_state(self.device, snapshot["default"])
        self.set_states(snapshot["streams"])


def seed_everything(seed: int, tp_rank: int, device: torch.device, pp_rank: int = 0) -> RNGStatesTracker:
    """Seed the default generator (same on every rank of a pipeline stage: replicated regions agree) and
    return a tracker whose tensor-parallel stream differs per TP rank (Megatron's offsets). Each pipeline stage's
    seeds are 100 x its rank further on (Megatron's), so its layers do not draw the same dropout masks as the
    other stages'. (Initial weights come from each parameter's own generator, not from these.)"""
    seed += 100 * pp_rank
    torch.manual_seed(seed)
    tracker = RNGStatesTracker(device)
    tracker.add(RNGStatesTracker.TENSOR_PARALLEL, seed + 2718 + tp_rank)
    return tracker


class _Recompute(torch.autograd.Function):
    """Run `function` without keeping activations; in backward, replay it with the RNG states it saw.
    The inputs and the RNG states are saved through `save_for_backward`, so saved-tensor hooks see (count,
    offload) them. `distribute` (a TP `CommGroup`, ZeRO-R's partitioned activation checkpoints / Megatron's
    --distribute-saved-activations): the first input is kept as this rank's 1/t slice of its flattened
    elements and all-gathered before the replay: the same values, a t-fold smaller checkpoint."""

    @staticmethod
    def forward(ctx, function, tracker: RNGStatesTracker, distribute, *inputs):
        ctx.function, ctx.tracker, ctx.distribute = function, tracker, distribute
        ctx.stream_names = list(tracker.states)
        rng_state, streams = _get_rng_state(tracker.device), tracker.get_states()
        saved = list(inputs)
        if distribute is not None:
            first = inputs[0]
            if first.numel() % distribute.size != 0:
                raise ValueError(f"a checkpoint of {first.numel()} elements does not split into "
                                 f"{distribute.size} equal slices (--distribute-saved-activations)")
            ctx.first_shape = first.shape
            saved[0] = first.detach().reshape(-1).chunk(distribute.size)[distribute.rank].clone()
        ctx.num_inputs = len(inputs)
        ctx.save_for_backward(*saved, rng_state, *(streams[name] for name in ctx.stream_names))
        with torch.no_grad():
            return function(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        inputs, rng_state = list(saved[:ctx.num_inputs]), saved[ctx.num_inputs]
        streams = dict(zip(ctx.stream_names, saved[ctx.num_inputs + 1:]))
        if ctx.distribute is not None:
            first = inputs[0]
            full = torch.empty(first.numel() * ctx.distribute.size, dtype=first.dtype, device=first.device)
            ctx.distribute.all_gather_into(full, first)
            inputs[0] = full.view(ctx.first_shape)
        # from needs_input_grad, not the saved tensors' flags: a saved-tensor hook (save_on_cpu) unpacks copies
        inputs = [x.detach().requires_grad_(needs) for x, needs in zip(inputs, ctx.needs_input_grad[3:])]
        tracker, device = ctx.tracker, ctx.tracker.device
        rng_now, tracker_now = _get_rng_state(device), tracker.get_states()
        _set_rng_state(device, rng_state)
        tracker.set_states(streams)
        with torch.enable_grad():
            outputs = ctx.function(*inputs)
        _set_rng_state(device, rng_now)
        tracker.set_states(tracker_now)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        torch.autograd.backward(outputs, grads)
        return (None, None, None) + tuple(x.grad if x.requires_grad else None for x in inputs)


def recompute(function, tracker: RNGStatesTracker, *inputs: torch.Tensor, distribute=None):
    """function(*inputs), with its activations recomputed in backward instead of stored; `distribute`: the TP
    group across which the first input is kept partitioned until the replay (None: kept whole)."""
    return _Recompute.apply(function, tracker, distribute, *inputs)
