"""Whether a run's sizes can exist on this machine at all, from the planner's arithmetic alone, before anything is
built or allocated: `--ffn-hidden-size 1000000000000` is one line here, not an allocator's traceback from the
model's construction (nor a machine swapping for an hour while it builds 10**7 layers).

The figure is a lower bound, so no real run is refused: the weight matrices and embeddings one rank holds (the
norms' and biases' few parameters left out) times the bytes per parameter of its precision, update rule and ZeRO
stage (`mpzero.zero.memory_formula`, all tiers counted: offloaded states live somewhere too), one micro-batch's
activations (`mpzero.activations` formula) and the Python objects of the layers, against everything the machine
has: host memory, the device's memory and, with a disk tier, the offload path's free space.
"""

from __future__ import annotations

import os
from typing import Callable

from mpzero.errors import ConfigError
from mpzero.zero import memory_formula

LAYER_OBJECT_BYTES = 32 << 10  # Python objects of one transformer layer built on meta tensors (tracemalloc: ~33 KB)


def parameters_per_rank(config, tp: int, pp: int = 1) -> dict[str, int]:
    """Trainable parameters of the most loaded rank by part, at least, from the shapes' arithmetic: the layers'
    weight matrices (QKV, projection, MLP; some pipeline stage holds at least ceil(layers / pp) of them), the
    vocabulary's embedding (and untied output layer) and learned positions (counted without pipeline stages: with
    them, the first and last stage hold these beside fewer layers)."""
    h, heads, d = config.hidden_size, config.num_attention_heads, config.head_dim
    qkv = h * (heads + 2 * config.query_groups) * d
    layer = (qkv + heads * d * h + h * config.ffn_size * (3 if config.swiglu else 2)) // tp
    vocabulary = config.padded_vocab_size(tp) * h // tp * (2 if config.untie_embeddings_and_output_weights else 1)
    positions = config.max_position_embeddings * h if config.learned_positions else 0
    if pp > 1:
        vocabulary = positions = 0
    return {"layers": -(-config.num_layers // pp) * layer, "vocabulary": vocabulary, "positions": positions}


def machine_bytes(device_type: str, offload_path: str | None) -> dict[str, int]:
    """What this machine has: host memory, the current CUDA device's memory, the offload path's free space."""
    have = {"host memory": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}
    if device_type == "cuda":
        import torch
        have["device memory"] = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if offload_path and os.path.isdir(offload_path):
        st = os.statvfs(offload_path)
        have["free disk"] = st.f_bavail * st.f_frsize
    return have


def check_scale(config, tp: int, dp: int, stage: int, bytes_per_param: tuple[int, int, int, int],
                activation_bytes: Callable[[], int], have: dict[str, int], pp: int = 1) -> None:
    """A ConfigError when the run's least memory (see the module's docstring) exceeds all of `have`; `dp` the
    ranks ZeRO partitions over, `bytes_per_param` (p, g, master, states) as `memory_formula` takes them,
    `activation_bytes()` one micro-batch's (asked only once the parameters fit: its formula walks every layer)."""
    replicated, partitioned = memory_formula(stage, *bytes_per_param)
    per_param = replicated + partitioned / dp
    params = parameters_per_rank(config, tp, pp)
    need = {name: count * per_param for name, count in params.items()}
    need["layers"] += -(-config.num_layers // pp) * LAYER_OBJECT_BYTES
    if sum(need.values()) <= sum(have.values()):
        need["activations"] = activation_bytes()
        if sum(need.values()) <= sum(have.values()):
            return
    largest = max(need, key=need.get)
    parts = " + ".join(f"{name} {_gib(n)}" for name, n in need.items() if n)
    machine = " + ".join(f"{name} {_gib(n)}" for name, n in have.items())
    raise ConfigError(f"this run needs at least {_gib(sum(need.values()))} per rank ({parts}; {sum(params.values()):,} "
                      f"parameters per TP rank at {per_param:g} bytes each) and this machine has "
                      f"{_gib(sum(have.values()))} ({machine}): most of it is the {largest}; check "
                      f"{_flags(largest)}")


def _flags(part: str) -> str:
    return {"layers": "--num-layers, --hidden-size, --ffn-hidden-size, --num-attention-heads",
            "activations": "--micro-batch-size, --seq-length, --hidden-size",
            "vocabulary": "--vocab-size or the tokenizer's, --hidden-size",
            "positions": "--max-position-embeddings, --seq-length, --hidden-size"}[part]


def _gib(nbytes: float) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):,.1f} {unit}"
    return f"{nbytes:.0f} B"
