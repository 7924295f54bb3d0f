"""megatron-core's own GPT on CPU gloo ranks, for tests of tools/import_megatron.py: a tiny model built at TP x PP,
saved by megatron-core's dist_checkpointing in the torch_dist format laid out as Megatron-LM's --save directory
(iter_NNNNNNN/ and latest_checkpointed_iteration.txt), and its logits on a batch from its own forward.

    logits = megatron_world(LLAMA, tp, pp, save_root, tokens)   # [b, s, padded vocab], from the last stage

megatron-core runs on a CPU as bench/bench_llama.py drives it (local layer spec, torch's norms, unfused softmax,
every CUDA fusion off, CPU initialization, dropout 0 so its CUDA RNG tracker is replaced by one that never
draws), with three CUDA-only calls stepped around while it runs, none in the maths: `torch.cuda.current_device()`
(where RoPE puts its frequencies, and the device of the save's failure flag) answers "cpu",
`torch.cuda.synchronize()` (after the save's device-to-host copies) does nothing, and `Tensor.cuda()` (the
tied embedding's copy moved to the GPU before the first and last stages all-reduce it) leaves the tensor where it
is. Pipeline stages pass activations as Megatron's schedule does, by send and recv, with `set_input_tensor`.

The ranks are processes forked by torch.multiprocessing that end normally, as a Megatron run's do: megatron-core's
writer keeps a multiprocessing Manager process per rank, which is shut down only by the ending process's
multiprocessing finalizers (tests/distributed.py's ranks end by os._exit, which would leave it running).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import zlib
from datetime import timedelta
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

PADDED_VOCAB, SEQ = 128, 32  # Megatron-LM pads the tokenizer's vocabulary before building the model
COMMON = dict(num_layers=4, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
              init_method_std=0.1, use_cpu_initialization=True, bias_activation_fusion=False,
              masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
              apply_rope_fusion=False, gradient_accumulation_fusion=False, pipeline_dtype=torch.float32)
# GPT-2 shaped: LayerNorm, exact GELU, biases, learned positions, tied output; norms stored under their own names,
# and in bf16 as Megatron-LM's bf16 runs store them (its Float16Module holds the model in bf16)
GPT2 = {"config": {}, "model": {"position_embedding_type": "learned_absolute",
                                "share_embeddings_and_output_weights": True}, "fused_norm_names": False,
        "stored_dtype": torch.bfloat16}
# LLaMA shaped: RMSNorm, SwiGLU, no biases, RoPE (theta 500000), 2 key/value groups, untied output
LLAMA = {"config": {"num_query_groups": 2, "ffn_hidden_size": 48, "normalization": "RMSNorm",
                    "gated_linear_unit": True, "activation_func": F.silu, "add_bias_linear": False,
                    "layernorm_epsilon": 1e-6},
         "model": {"position_embedding_type": "rope", "rotary_base": 500000,
                   "share_embeddings_and_output_weights": False}, "fused_norm_names": True}


@contextlib.contextmanager
def on_cpu():
    """megatron-core's CUDA-only calls stepped around (the module's docstring); its RNG tracker never draws."""
    from megatron.core.tensor_parallel import random as megatron_random

    class NoDrawTracker:  # dropout 0: the forks around dropout and initialization draw nothing from it
        def fork(self, name=None):
            return contextlib.nullcontext()
    megatron_random._CUDA_RNG_STATE_TRACKER = NoDrawTracker()
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    with mock.patch("torch.cuda.current_device", lambda: "cpu"), \
            mock.patch("torch.cuda.synchronize", lambda *args: None), \
            mock.patch("torch.Tensor.cuda", lambda self, *args, **kwargs: self):
        yield


def build(spec: dict, tp: int, pp: int):
    """This rank's stage of megatron-core's GPTModel (after `initialize_model_parallel(tp, pp)`), its norms and
    biases moved off their ones and zeros (a trained model's), each the same on every TP rank."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(**COMMON, **spec["config"], tensor_model_parallel_size=tp,
                               pipeline_model_parallel_size=pp)
    layer_spec = get_gpt_layer_local_spec(normalization=spec["config"].get("normalization", "LayerNorm"))
    if not spec["fused_norm_names"]:  # as specs without the key map store them: input_layernorm, pre_mlp_layernorm
        layer_spec.submodules.sharded_state_dict_keys_map = {}
    torch.manual_seed(1234)
    model = GPTModel(config, layer_spec, vocab_size=PADDED_VOCAB, max_sequence_length=SEQ,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(), **spec["model"])
    stage = parallel_state.get_pipeline_model_parallel_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                generator = torch.Generator().manual_seed(zlib.crc32(f"{stage}/{name}".encode()))
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
    return model.eval()


def forward(model, tokens: torch.Tensor, tp: int, pp: int) -> torch.Tensor | None:
    """The logits [b, s, padded vocab] of `tokens` [b, s] on the last stage (None elsewhere), stage to stage by
    send and recv as Megatron's pipeline schedule passes them."""
    from megatron.core import parallel_state

    b, s = tokens.shape
    positions = torch.arange(s)[None].expand(b, -1)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)  # True: masked
    if not parallel_state.is_pipeline_first_stage():
        hidden = torch.empty(s, b, model.config.hidden_size)
        dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    with torch.no_grad():
        out = model(tokens, positions, mask)
    if not parallel_state.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
        return None
    shards = [torch.empty_like(out) for _ in range(tp)]
    dist.all_gather(shards, out.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=-1)


def megatron_world(spec: dict, tp: int, pp: int, save_root: str, tokens: torch.Tensor, iteration: int = 10,
                   sharded_metadata: dict | None = None, deadline: float = 240.0) -> torch.Tensor:
    """megatron-core's GPT of `spec` at tp x pp saved under SAVE_ROOT (Megatron-LM's layout, `iteration`) and its
    logits of `tokens` [b, s]. `sharded_metadata`: options of its sharded state dict (singleton_local_shards)."""
    os.makedirs(save_root)
    store, result = f"{save_root}.store", f"{save_root}.logits.pt"  # beside it: the checkpoint stays Megatron's
    context = mp.start_processes(_rank, (tp, pp, store, spec, save_root, tokens, iteration, sharded_metadata,
                                         result, deadline), nprocs=tp * pp, join=False, start_method="fork")
    end = time.monotonic() + deadline
    try:
        while not context.join(timeout=max(end - time.monotonic(), 0)):
            if time.monotonic() >= end:
                raise AssertionError(f"megatron-core's ranks did not finish within {deadline:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
        if os.path.exists(store):
            os.remove(store)
    logits = torch.load(result, weights_only=True)  # written by the last stage, below
    os.remove(result)
    return logits


def _rank(rank: int, tp: int, pp: int, store: str, spec: dict, save_root: str, tokens: torch.Tensor, iteration: int,
          sharded_metadata: dict | None, result: str, deadline: float) -> None:
    torch.set_num_threads(1)  # a forked child starting an OpenMP pool its parent used can deadlock
    # megatron-core imports wandb if it can, whose import makes temporary folders removed at interpreter exit,
    # which a multiprocessing child never reaches: without it (megatron-core runs on) nothing is left behind
    sys.modules.setdefault("wandb", None)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=tp * pp,
                            timeout=timedelta(seconds=deadline - 10))
    logits = _save_and_forward(spec, tp, pp, save_root, tokens, iteration, sharded_metadata)
    if logits is not None:
        torch.save(logits, result)
    dist.barrier()
    dist.destroy_process_group()


def _save_and_forward(spec: dict, tp: int, pp: int, save_root: str, tokens: torch.Tensor, iteration: int,
                      sharded_metadata: dict | None):
    """On every rank: build, save to SAVE_ROOT/iter_NNNNNNN (megatron-core's torch_dist writer) with Megatron-LM's
    tracker file, and return the logits of `tokens` (first TP rank of the last stage; None elsewhere)."""
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(tp, pp)
    with on_cpu():
        model = build(spec, tp, pp)
        directory = os.path.join(save_root, f"iter_{iteration:07d}")
        os.makedirs(directory, exist_ok=True)
        model.to(spec.get("stored_dtype", torch.float32))
        state = {"model": model.sharded_state_dict(metadata=sharded_metadata), "iteration": iteration}
        dist_checkpointing.save(state, directory, sharded_strategy=("torch_dist", 1))
        model.float()  # the logits of the stored weights, in fp32 as mpzero computes them
        dist.barrier()
        if dist.get_rank() == 0:
            with open(os.path.join(save_root, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(iteration))
        logits = forward(model, tokens, tp, pp)
    keep = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
    return logits if keep else None
