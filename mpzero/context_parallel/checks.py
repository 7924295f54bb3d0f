"""The checks of the context-parallel flags, called by the model config's `validate` (models/config.py): the
sequence split into 2·CP chunks, a2a's heads and groups, and what the CP attention does not take."""

from __future__ import annotations

from mpzero.errors import ConfigError

CP_COMM_TYPES = ("p2p", "all_gather", "a2a")


def check_context_parallel(config, tp_size: int) -> None:
    """Megatron's rules for --context-parallel-size and --cp-comm-type on a transformer `config` (a GPTConfig) at TP
    `tp_size`, and what mpzero's CP attention takes; each a one-line ConfigError."""
    cp, comm = config.context_parallel_size, config.cp_comm_type
    if comm not in CP_COMM_TYPES:
        raise ConfigError(f"--cp-comm-type {comm} is not one of {', '.join(CP_COMM_TYPES)}")
    if cp < 1:
        raise ConfigError(f"--context-parallel-size {cp} must be positive")
    if cp == 1:
        return
    seq = config.seq_length or config.max_position_embeddings
    if seq % (2 * cp):
        raise ConfigError(f"--seq-length {seq} is not divisible by 2 x --context-parallel-size {cp} = {2 * cp}: "
                          f"each CP rank holds two of 2·CP equal chunks (causal load balance)")
    if config.sequence_parallel and (seq // cp) % tp_size:
        raise ConfigError(f"--sequence-parallel: the {seq // cp} tokens of a CP rank (--seq-length {seq} / "
                          f"--context-parallel-size {cp}) are not divisible by --tensor-model-parallel-size "
                          f"{tp_size}")
    heads, groups = config.num_attention_heads // tp_size, config.query_groups // tp_size
    if comm == "a2a" and (heads % cp or groups % cp):
        raise ConfigError(f"--cp-comm-type a2a splits each TP rank's {heads} heads and {groups} key/value groups "
                          f"over --context-parallel-size {cp}: both must be divisible by it (use p2p or "
                          f"all_gather)")
    if config.attention_dropout > 0:
        raise ConfigError(f"--context-parallel-size {cp}: the context-parallel attention has no attention "
                          f"dropout: pass --attention-dropout 0")
    if config.cp_blockwise and config.attention_backend_name == "fused":
        raise ConfigError(f"--cp-comm-type {comm} runs its blocks with the CPU's flash kernel or explicit scores, "
                          f"not cuDNN's fused attention (--attention-backend fused): use --attention-backend "
                          f"auto, flash or local, or --cp-comm-type a2a")
    if config.torch_compile:
        raise ConfigError(f"--context-parallel-size {cp} with --torch-compile is not supported yet (the CP "
                          f"attention's exchanges run eagerly): drop --torch-compile")
