"""Models built from mpzero's tensor-parallel layers: the transformer (`GPTModel`, GPT-2 and the LLaMA family) whose
parts (`models/blocks.py`, `models/attention.py`) its config (`models/config.py`) chooses."""

from mpzero.models.config import GPTConfig, TransformerArchitecture
from mpzero.models.gpt import GPTModel
from mpzero.models.kv_cache import KVCache

__all__ = ["GPTConfig", "GPTModel", "KVCache", "TransformerArchitecture"]
