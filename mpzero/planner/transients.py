"""What a rank's device holds beyond the model states and the saved activations, at two moments the steady-state
formulas do not see: while the model and its ZeRO optimizer are built, and the working tensors of a step.

Construction (`construction_peak`), simulated from the code's order of allocations, per rank:
- `GPTModel` builds every parameter of its TP rank in fp32 on the device (4 bytes x its numel), whatever the ZeRO
  stage: the weights exist whole before ZeRO flattens them;
- stages 0-2, bucket by bucket: the bucket's fp32 values (4E), their cast (pE, mixed precision), this rank's fp32
  slice (4S, mixed precision: the masters' starting values); binding frees the bucket's fp32 parameters;
- stage 3, unit by unit: the fp32 values and cast (4E, pE), this rank's shard (pS) and fp32 slice (4S, mixed); then
  every unit's full buffer is allocated (pE each, on a GPU; CPU pages stay untouched) before the bindings free the
  fp32 parameters and the buffers are released;
- then gradient buffers, the masters (cloned from the fp32 slices, which are freed after) and the update rule's
  states (`state_bytes` per owned element: AdamW's two moments 8, SGD's momentum buffer 4).
So the fp32 model (4P per TP rank) is on every device at the start, and at stage 3 also the full low-precision
model for a moment: ZeRO's partitioned sizes are reached only after construction.

Working tensors of a step (`compute_transients`), an estimate from what the code computes (not counted by any line):
- cross entropy, backward: the fp32 softmax with the target subtracted, its product with the loss gradient and
  their cast (8 + e) x s b V/t bytes (the saved softmax itself is an activation); chunked
  (`cross_entropy_chunk_size` c), one chunk's recomputed fp32 logits, worked on in place, and their cast:
  (4 + e) x min(c, s b) x V/t (4 x ... in fp32, where the cast is the same tensor);
- the vocabulary gradients: the output projection's weight gradient and the embedding's dense gradient, and (tied)
  their sum, e x V/t x h each, held until the end of backward;
- attention backward: the softmax's gradient and its fp32 working copies, 3 x 4 x a/t s^2 b (none with
  flash attention: --attention-backend flash or fused, and auto on a GPU);
- the optimizer step: the global norm's fp64 chunk (8 x up to 4M elements; + its fp32 unscaled cast, 4 x, for
  fp16's loss-scaled gradients), then, with gradients in the parameters' dtype (fp16, bf16 with
  --grad-reduce-in-bf16), the fp32 cast of one bucket's shard at a time (4 x the largest shard: `Fp32Buckets`;
  with an offloaded optimizer two sub-groups' pieces, 4 x 2 min(G, S): `accounting.step_fp32_bytes`); the larger
  of the two.
The step's peak takes the largest of the backward ones beside the saved activations, and the step's beside the states.
"""

from __future__ import annotations

from mpzero.zero.norm import CHUNK


def construction_peak(layouts, stage: int, p: int, mixed: bool, g: int, cuda: bool, optimizer_offloaded: bool,
                      params_offloaded: bool, state_bytes: int) -> int:
    """Device bytes at the high-water mark of building the model and its ZeRO optimizer (see the module docstring)."""
    numel = sum(layout.numel for layout in layouts)
    shards = sum(layout.shard_numel for layout in layouts)
    owned = sum(end - start for layout in layouts for start, end, _ in layout.decay_runs())
    live = peak = 4 * numel  # the fp32 model
    slice_bytes = 4 if mixed else 0  # the fp32 slice kept for the masters (fp32: a view of the parameters)
    for layout in layouts:
        e, s = layout.padded_numel, layout.shard_numel
        if stage < 3:
            cast = p * e if mixed else 0
            peak = max(peak, live + 4 * e + cast + slice_bytes * s)
            live += (cast if mixed else 4 * e) + slice_bytes * s - 4 * layout.numel
        else:
            kept = 0 if params_offloaded else p * s + slice_bytes * s  # offloaded: shard and slice go to the host
            peak = max(peak, live + 4 * e + (p * e if mixed else 0) + kept)
            live += kept
    if stage == 3:
        partitioned = layouts[0].parts > 1
        if cuda and (partitioned or params_offloaded):
            peak = max(peak, live + p * sum(layout.padded_numel for layout in layouts))
        live -= 4 * numel
    live += g * (sum(layout.padded_numel for layout in layouts) if stage < 2 else shards)  # gradient buffers
    if not optimizer_offloaded:
        live += (4 * shards if mixed else 0) + state_bytes * owned  # masters (cloned while the fp32 slices live), states
    peak = max(peak, live)
    return peak


def compute_transients(config, tp: int, micro_batch: int, seq: int, e: int, g: int, fp32_grad_numel: int,
                       largest_run: int, cuda: bool = True, loss_scaled: bool = False) -> dict[str, int]:
    """Bytes of each working-tensor term (see the module docstring) for one micro-batch on one rank, on a GPU
    (`cuda`) or the CPU (the attention backend `auto` picks differs). fp32_grad_numel: the gradient elements the
    step casts to fp32 at once when g < 4; loss_scaled: fp16's norm unscales each chunk."""
    v, h = config.padded_vocab_size(tp) // tp, config.hidden_size
    sb = seq * micro_batch
    tied = not config.untie_embeddings_and_output_weights
    flash = config.planned_attention("cuda" if cuda else "cpu") in ("flash", "fused")
    attention = 0 if flash else 3 * 4 * (config.num_attention_heads // tp) * seq * seq * micro_batch
    chunk = config.cross_entropy_chunk_size
    cross_entropy = ((4 + (e if e < 4 else 0)) * min(chunk, sb) * v if chunk else
                     (8 + (e if e < 4 else 0)) * sb * v)
    return {"cross entropy": cross_entropy,
            "vocabulary gradients": (3 if tied else 2) * e * v * h,
            "attention backward": attention,
            "optimizer step": max((12 if loss_scaled and g < 4 else 8) * min(CHUNK, largest_run),
                                  4 * fp32_grad_numel if g < 4 else 0)}
