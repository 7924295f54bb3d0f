"""Using a trained GPT: checkpoints to models at any TP size, KV-cache generation, Hugging Face GPT-2 conversion.

tools/generate.py, tools/export_hf.py and tools/import_hf.py are the commands; this package is their library.
Training never imports it."""

from mpzero.inference.generation import (KVCache, SamplingConfig, filter_logits, forward_cached, forward_full,
                                         generate, next_tokens)
from mpzero.inference.hf_gpt2 import (from_hf_state_dict, gpt_config_from_hf, hf_config, model_flags,
                                      to_hf_state_dict)
from mpzero.inference.run_tokenizer import RunTokenizer, run_tokenizer
from mpzero.inference.weights import check_gpt_weights, expected_shapes, gpt_config_from_meta, load_full_weights

__all__ = ["KVCache", "SamplingConfig", "filter_logits", "forward_cached", "forward_full", "generate", "next_tokens",
           "from_hf_state_dict", "gpt_config_from_hf", "hf_config", "model_flags", "to_hf_state_dict",
           "RunTokenizer", "run_tokenizer", "check_gpt_weights", "expected_shapes", "gpt_config_from_meta",
           "load_full_weights"]
