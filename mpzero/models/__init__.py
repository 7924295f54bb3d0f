"""Models built from mpzero's tensor-parallel layers, and their family records.

`family_of(config)` gives the record (`ModelFamily`: config class, flags, build, FLOPs, activation setting, TP
traffic, HF adapter, architecture check) that the planner, the dry run, inference and the tools use instead of
naming a model. `FAMILIES`: GPT-2 and LLaMA, two entries over the one transformer (`GPTModel`, `GPTConfig`),
whose parts (`models/blocks.py`, `models/attention.py`) the config chooses.
"""

from mpzero.models.config import (CUDA_GRAPH_IMPLS, NORMALIZATIONS, POSITION_EMBEDDINGS, GPTConfig,
                                  TransformerArchitecture)
from mpzero.models.family import FAMILIES, GPT2, LLAMA, ModelFamily, config_from_args, family_of
from mpzero.models.gpt import GPTModel
from mpzero.models.kv_cache import KVCache
from mpzero.models.stage import LayerStack, ModelStage

__all__ = ["CUDA_GRAPH_IMPLS", "NORMALIZATIONS", "POSITION_EMBEDDINGS", "GPTConfig", "GPTModel", "KVCache",
           "LayerStack", "ModelStage",
           "TransformerArchitecture", "FAMILIES", "GPT2", "LLAMA", "ModelFamily", "config_from_args", "family_of"]
