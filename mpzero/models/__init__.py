"""Models built from mpzero's tensor-parallel layers."""

from mpzero.models.gpt import GPTConfig, GPTModel
from mpzero.models.kv_cache import KVCache

__all__ = ["GPTConfig", "GPTModel", "KVCache"]
