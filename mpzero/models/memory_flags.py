"""Megatron's rules for a transformer config's recomputation, sequence-parallel and activation-offload flags
(`GPTConfig.validate`), each a one-line ConfigError."""

from __future__ import annotations

from mpzero.errors import ConfigError


def check_activation_memory(config, tp_size: int) -> None:
    """Megatron's rules for the recomputation and sequence-parallel flags, each a one-line error."""
    g = config.recompute_granularity
    if g not in (None, "selective", "full"):
        raise ConfigError(f"--recompute-granularity {g} is not one of full, selective")
    if config.recompute_activations and g == "full":
        raise ConfigError("--recompute-activations is selective recomputation, but --recompute-granularity full "
                          "was given too: keep one of them")
    granularity = config.granularity
    if config.recompute_method not in (None, "uniform", "block"):
        raise ConfigError(f"--recompute-method {config.recompute_method} is not one of uniform, block")
    for flag, value in (("--recompute-method", config.recompute_method),
                        ("--recompute-num-layers", config.recompute_num_layers)):
        if value is not None and granularity != "full":
            raise ConfigError(f"{flag} {value} needs --recompute-granularity full (selective recomputation "
                              f"recomputes the core attention of every layer)")
    n = config.recompute_num_layers
    if n is not None and not 1 <= n <= config.num_layers:
        raise ConfigError(f"--recompute-num-layers {n} is out of range: it must be between 1 and --num-layers "
                          f"{config.num_layers}")
    if config.sequence_parallel:
        if tp_size == 1:
            raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1: it splits the "
                              "sequence across the TP group (Megatron turns it off at TP 1)")
        seq = config.seq_length or config.max_position_embeddings
        if seq % tp_size:
            raise ConfigError(f"--sequence-parallel: --seq-length {seq} is not divisible by "
                              f"--tensor-model-parallel-size {tp_size}")
    if config.distribute_saved_activations:
        if tp_size == 1:
            raise ConfigError("--distribute-saved-activations needs --tensor-model-parallel-size > 1: it keeps "
                              "each checkpoint as 1/t slices across the TP group")
        if granularity != "full":
            raise ConfigError("--distribute-saved-activations needs --recompute-granularity full: only full "
                              "recomputation keeps checkpoints to distribute")
        if config.sequence_parallel:
            raise ConfigError("--distribute-saved-activations cannot be combined with --sequence-parallel (as in "
                              "Megatron): the checkpoints are already 1/t slices of the sequence")
    if config.offload_activations not in ("none", "cpu"):
        raise ConfigError(f"--offload-activations {config.offload_activations} is not one of none, cpu")
