"""Models built from mpzero's tensor-parallel layers."""

from mpzero.models.gpt import GPTConfig, GPTModel

__all__ = ["GPTConfig", "GPTModel"]
