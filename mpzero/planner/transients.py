"""What a rank's device holds beyond the model states and the saved activations: the working tensors of a step.

Construction is streamed (`mpzero.zero.construction`): its device peak is the model states plus one bucket's or
unit's working set, `construction_working_set`, which the plan adds to the states.

Working tensors of a step (`compute_transients`), an estimate from what the code computes (not counted by any line):
- cross entropy, backward: the fp32 softmax with the target subtracted, its product with the loss gradient and
  their cast (8 + e) x s b V/t bytes (the saved softmax itself is an activation); chunked
  (`cross_entropy_chunk_size` c), the last chunk's c' tokens first: their kept exponentials (an activation),
  worked on in place, and their cast, e c' V/t; then, those released, each other chunk's recomputed fp32 logits and
  their cast: (4 + e) c V/t - 4 c' V/t beside the activations (the cast is the same tensor in fp32: e counts 0
  there). Fused (`--cross-entropy-loss-fusion`, `mpzero.fused.cross_entropy`): no fp32 copy, each pass writes a
  new tensor beside its input: the kept chunk's gradient, e c' V/t, then each other chunk's product and its
  gradient, 2 e c V/t - 4 c' V/t (in fp32 more than the reference's in-place passes, in bf16 less);
- the vocabulary gradients: the output projection's weight gradient and the embedding's dense gradient, and (tied)
  their sum, e x V/t x h each, held until the end of backward (a pipeline stage: those of the ends it holds);
- attention backward: the softmax's gradient and its fp32 working copies, 3 x 4 x a/t s^2 b (none with
  flash attention: --attention-backend flash or fused, and auto on a GPU). Context parallelism: s is a rank's
  s/CP tokens everywhere; the ring's and all-gather's blocks (`mpzero.context_parallel.blocks`) hold, in explicit
  scores (on CUDA, or --attention-backend local), the same three fp32 tensors per head for a tile of at most
  TILE_ROWS query rows over their largest block's s/CP keys (the own chunks'), none on the CPU's flash kernel;
  a2a's attention runs over all s tokens for a/CP heads;
- the optimizer step: the global norm's fp64 chunk (8 x up to 4M elements, on a CPU 256K; + its fp32 unscaled cast,
  4 x, for fp16's loss-scaled gradients; on a GPU, whose `sum_of_squares` kernel upcasts in registers, 8 bytes
  per 4096 elements of the largest run), then, with gradients in the parameters' dtype (fp16, bf16 with
  --grad-reduce-in-bf16), the fp32 cast of one bucket's shard at a time (4 x the largest shard: `Fp32Buckets`;
  with an offloaded optimizer two sub-groups' pieces, 4 x 2 min(G, S): `accounting.step_fp32_bytes`); the larger
  of the two.
The step's peak takes the largest of the backward ones beside the saved activations, and the step's beside the states.
"""

from __future__ import annotations

from mpzero.activations import kept_chunk_tokens
from mpzero.context_parallel import TILE_ROWS, block_kernel
from mpzero.fused import planned_impl, sum_of_squares_bytes


def compute_transients(config, tp: int, micro_batch: int, seq: int, e: int, g: int, fp32_grad_numel: int,
                       largest_run: int, cuda: bool = True, loss_scaled: bool = False, first: bool = True,
                       last: bool = True) -> dict[str, int]:
    """Bytes of each working-tensor term (see the module docstring) for one micro-batch on one rank, on a GPU
    (`cuda`) or the CPU (the attention backend `auto` picks differs). fp32_grad_numel: the gradient elements the
    step casts to fp32 at once when g < 4; loss_scaled: fp16's norm unscales each chunk. A pipeline rank that
    does not begin the model (`first`) has no embedding gradient, one that does not end it (`last`) no output
    projection's gradient and no cross entropy."""
    v, h = config.padded_vocab_size(tp) // tp, config.hidden_size
    cp = config.context_parallel_size
    local = seq // cp  # a context-parallel rank's tokens
    sb = local * micro_batch
    tied = not config.untie_embeddings_and_output_weights
    device = "cuda" if cuda else "cpu"
    flash = config.planned_attention(device) in ("flash", "fused")
    heads, rows, keys = config.num_attention_heads // tp, seq, seq  # the core's heads per rank, its scores' shape
    if config.cp_blockwise:  # the CPU's flash kernel per block, or explicit scores a tile of rows at a time
        flash = block_kernel(config.attention_backend_name, device) == "flash"
        rows, keys = min(TILE_ROWS, local), local
    elif cp > 1:  # a2a: 1/CP of the heads over the whole sequence
        heads //= cp
    attention = 0 if flash else 3 * 4 * heads * rows * keys * micro_batch
    chunk, cast = config.cross_entropy_chunk_size, (e if e < 4 else 0)
    fused = planned_impl("cross_entropy", device, config.cross_entropy_impl) == "compile"
    if chunk:  # the kept last chunk worked on in place and cast; released, then each other chunk recomputed
        kept = kept_chunk_tokens(sb, chunk)
        kept_bytes, other_bytes = (e, 2 * e) if fused else (cast, 4 + cast)
        cross_entropy = max(kept_bytes * kept * v, other_bytes * chunk * v - 4 * kept * v if sb > chunk else 0)
    else:
        cross_entropy = (8 + cast) * sb * v
    if not last:
        cross_entropy = 0
    vocabulary = first + last + (tied and first and last)  # the embedding's, the output's and (tied) their sum
    return {"cross entropy": cross_entropy,
            "vocabulary gradients": vocabulary * e * v * h,
            "attention backward": attention,
            "optimizer step": max(sum_of_squares_bytes(largest_run, planned_impl("sum_of_squares", device),
                                                       scaled=loss_scaled and g < 4, device=device),
                                  4 * fp32_grad_numel if g < 4 else 0)}
