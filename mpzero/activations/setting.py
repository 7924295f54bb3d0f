"""What the activation formula is computed from and summed of: `ActivationSetting`, every knob one rank's
activation bytes depend on, with `check_setting`, the combinations the code runs; and `Term`, one named byte count
with its expression. Shared by the layers' formula (formula.py) and the terms outside the layers (outside.py).

A setting describes one pipeline stage (`for_stage`): its transformer layers by model chunk (global indices, as
the model numbers its activation regions), whether it begins the model (token ids, the embedding) and whether it
ends it (final norm, logits, loss); by default the whole model, one chunk.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GRANULARITIES = ("selective", "full")
METHODS = ("uniform", "block")
CPU_RNG_STATE_BYTES = 5056  # torch.get_rng_state(): the MT19937 state of the CPU generator
CUDA_RNG_STATE_BYTES = 16  # torch.cuda.get_rng_state(): Philox seed and offset


@dataclass(frozen=True)
class ActivationSetting:
    """Everything the activation bytes of one rank depend on."""
    seq_length: int  # s: the tokens of this rank (s/CP of the sequence under context parallelism)
    micro_batch_size: int  # b
    hidden_size: int  # h
    num_attention_heads: int  # a
    num_layers: int
    vocab_size: int  # the real vocabulary
    padded_vocab_size: int  # all TP ranks together
    tp: int = 1  # t
    tp_rank: int = 0  # only the vocabulary padding mask depends on it
    dtype_bytes: int = 4  # e: activations and parameters (ZeRO casts both)
    mask_bytes: int | None = None  # m: dropout masks; None: e (the CPU path); 1 on CUDA
    hidden_dropout: bool = True
    attention_dropout: bool = True
    sequence_parallel: bool = False
    recompute_granularity: str | None = None  # None, "selective", "full"
    recompute_method: str | None = None  # with "full": "uniform" or "block"
    recompute_num_layers: int | None = None  # with "full"
    distribute_saved_activations: bool = False
    offload_activations: bool = False  # host tier: checkpoints (full) or every saved tensor of a layer
    layernorm_impl: str = "torch"
    softmax_impl: str = "torch"
    flash_attention: bool = False  # the attention backend is SDPA's (flash or fused)
    compiled_layers: bool = False  # --torch-compile: the layers' saved tensors are the compiler's choice
    rng_state_bytes: int = CPU_RNG_STATE_BYTES
    rng_streams: int = 1  # tracker streams saved beside the default generator
    cross_entropy_chunk_size: int = 0  # > 0: the output projection and the loss fused, chunk by chunk of tokens
    # The LLaMA family's shapes and parts (GPT-2's by default):
    ffn_hidden_size: int | None = None  # f; None: 4h
    num_query_groups: int | None = None  # g, the K/V heads; None: a
    kv_channels: int | None = None  # d, each head's size (--kv-channels); None: h/a
    rms_norm: bool = False  # RMSNorm instead of LayerNorm
    swiglu: bool = False  # the gated MLP: [gate; up] output 2f, SiLU output f, down-projection input f
    rotary: bool = False  # RoPE: rotated copies of q and k
    qk_layernorm: bool = False  # --qk-layernorm: what the q and k norms keep (activations/qk_norm.py)
    learned_positions: bool = True  # position ids kept by the learned position embedding
    cp: int = 1  # context-parallel ranks (mpzero.context_parallel); the sequence is cp x seq_length tokens
    cp_comm_type: str = "p2p"  # with cp > 1: p2p and all_gather keep what flash keeps; a2a runs its core on a/cp
    # heads over the cp x seq_length tokens
    moe_layers: int = 0  # mixture-of-experts layers (mpzero.moe)
    moe: object | None = None  # their shape (`mpzero.activations.moe.MoEShape`: the model's, with its EP grid)
    # The pipeline stage (the whole model by default):
    chunks: tuple[tuple[int, ...], ...] | None = None  # its layers' global indices by model chunk; None: all, one
    first_stage: bool = True  # it begins the model: token ids, position ids, the embedding's dropout mask
    last_stage: bool = True  # it ends the model: final norm, logits' input, cross entropy

    @property
    def head_dim(self) -> int:
        """d: --kv-channels, else h/a (so a d, q's and the projection input's width, is h by default)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def layer_chunks(self) -> tuple[tuple[int, ...], ...]:
        return self.chunks if self.chunks is not None else (tuple(range(self.num_layers)),)

    @property
    def layer_indices(self) -> tuple[int, ...]:
        """The stage's layers' global indices, chunk after chunk (the order of `activation_formula`'s layers)."""
        return tuple(i for chunk in self.layer_chunks for i in chunk)

    def for_stage(self, chunks, first: bool, last: bool) -> ActivationSetting:
        """This setting for a pipeline stage (`mpzero.models.ModelStage`'s chunks, first, last)."""
        return dataclasses.replace(self, chunks=tuple(tuple(chunk) for chunk in chunks), first_stage=first,
                                   last_stage=last)


@dataclass(frozen=True)
class Term:
    name: str
    text: str  # in s, b, h, a, t, e, m, with e and m substituted
    bytes: int
    paper: bool = False  # a Korthikanti item; else an implementation term mpzero adds


def check_setting(setting: ActivationSetting) -> None:
    """The combinations the code runs; raises ValueError otherwise (flags are checked earlier, in one line)."""
    g, method, n = setting.recompute_granularity, setting.recompute_method, setting.recompute_num_layers
    if g not in (None,) + GRANULARITIES:
        raise ValueError(f"recompute granularity {g!r} is not one of {GRANULARITIES}")
    if g == "full" and (method not in METHODS or not n or not 1 <= n <= setting.num_layers):
        raise ValueError(f"full recomputation needs a method in {METHODS} and 1 <= layers <= {setting.num_layers}")
    if g != "full" and (method is not None or n is not None or setting.distribute_saved_activations):
        raise ValueError("a recompute method, layer count or distributed checkpoints need full recomputation")
    if setting.distribute_saved_activations and (setting.tp == 1 or setting.sequence_parallel):
        raise ValueError("distributed checkpoints need TP > 1 and no sequence parallelism")
    if setting.sequence_parallel and (setting.tp == 1 or setting.seq_length % setting.tp):
        raise ValueError("sequence parallelism needs TP > 1 and a sequence length divisible by TP")
    if any(not 0 <= i < setting.num_layers for i in setting.layer_indices) or not setting.layer_chunks:
        raise ValueError(f"a stage's layers {setting.layer_chunks} must lie in [0, {setting.num_layers})")
