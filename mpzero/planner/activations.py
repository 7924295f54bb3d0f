"""The planner's one call for activation memory: bytes one rank keeps for backward, per layer and per micro-batch,
for a layout. Both halves are the code's own: the GPT's `activation_setting` (what its forward does for this
config, TP rank, dtype and device type) and the activation-memory module's `activation_formula` (the one source
of truth behind the run's `activation memory` line). Where the module is missing (an mpzero without issue 11)
or does not model the setting (flash attention), the answer is None and the planner says activations are not
counted; it never substitutes a formula of its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from mpzero.errors import ConfigError


@dataclass(frozen=True)
class ActivationPlan:
    """Device bytes of activations on one rank for one micro-batch in flight."""
    per_layer: tuple[int, ...]  # what each transformer layer keeps after the forward (on the device)
    outside: int  # embedding, final LayerNorm, logits, loss
    recompute_transient: int  # in backward, a recomputed layer's tensors beyond what it kept
    host: int  # kept in host memory (--offload-activations cpu; 0 when not modeled)
    text: str  # the first layer's formula (Korthikanti's row and mpzero's terms)

    @property
    def saved(self) -> int:
        """What a micro-batch's forward keeps for its backward (the `activation memory` line's micro-batch)."""
        return sum(self.per_layer) + self.outside

    @property
    def peak(self) -> int:
        """The most activation bytes alive in a step: the saved bytes plus one layer recomputed in backward."""
        return self.saved + self.recompute_transient


def available() -> bool:
    try:
        from mpzero.activations import activation_formula  # noqa: F401 (the probe)
    except ImportError:
        return False
    return True


def activation_setting(config, tp: int, tp_rank: int, micro_batch: int, seq: int, dtype: torch.dtype, cuda: bool):
    """`GPTModel.activation_setting` of the model `config` builds at TP rank `tp_rank` of `tp` (with the one RNG
    tracker stream `seed_everything` adds), on a GPU (`cuda`) or the CPU; None without the module."""
    try:
        from mpzero.models.gpt import GPTModel
        GPTModel.activation_setting  # noqa: B018  (an mpzero without issue 11 has none)
    except (ImportError, AttributeError):
        return None
    model = SimpleNamespace(config=config, tp=SimpleNamespace(size=tp, rank=tp_rank),
                            rng=SimpleNamespace(states={"tensor-parallel": None}))
    device = torch.device("cuda" if cuda else "cpu")
    try:
        return GPTModel.activation_setting(model, micro_batch, seq, dtype, device)
    except ConfigError:  # planning for a GPU on a machine without Triton: what `auto` picks there
        from mpzero.activations.formula import CUDA_RNG_STATE_BYTES
        setting = GPTModel.activation_setting(model, micro_batch, seq, dtype, torch.device("cpu"))
        impl = {name: "triton" if getattr(config, f"{name}_impl") == "auto" else "torch"
                for name in ("layernorm", "softmax")}
        return dataclasses.replace(setting, mask_bytes=1, layernorm_impl=impl["layernorm"],
                                   softmax_impl=impl["softmax"], rng_state_bytes=CUDA_RNG_STATE_BYTES)


def activation_plan(config, tp: int, micro_batch: int, seq: int, dtype: torch.dtype, cuda: bool = True,
                    tp_rank: int = 0) -> ActivationPlan | None:
    """Activation bytes of TP rank `tp_rank` for a micro-batch of `micro_batch` x `seq` tokens of the GPT `config`
    (its recomputation, sequence-parallel and offload settings) at TP `tp`; None where not modeled."""
    setting = activation_setting(config, tp, tp_rank, micro_batch, seq, dtype, cuda)
    if setting is None:
        return None
    from mpzero.activations import formula as af
    if af.modeled(setting) is not None:
        return None
    formula = af.activation_formula(setting)
    stored = af.layer_formula(setting, "stored").bytes
    kinds = {layer.kind for layer in formula.layers}
    # in backward a recomputed layer holds what the stored layer holds until its own backward is done
    transient = 0
    if "checkpoint" in kinds or "selective" in kinds:
        chunk = setting.recompute_num_layers if setting.recompute_method == "uniform" else 1
        kept = max(layer.device_bytes for layer in formula.layers if layer.kind != "stored")
        transient = max(stored * (chunk or 1) - kept, 0)
    host = sum(layer.host_bytes or 0 for layer in formula.layers)
    text = formula.layers[0].text() if formula.layers else "0"
    return ActivationPlan(tuple(formula.layer_bytes), formula.outside_bytes, transient, host, text)


def normalized(config):
    """`config` with every activation-memory setting at its default: the parameters do not depend on them."""
    names = [f.name for f in dataclasses.fields(config)]
    defaults = {f.name: f.default for f in dataclasses.fields(config)
                if f.name.startswith("recompute") or f.name in ("sequence_parallel", "distribute_saved_activations",
                                                                 "offload_activations")}
    return dataclasses.replace(config, **{k: v for k, v in defaults.items() if k in names})
