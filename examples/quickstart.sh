#!/usr/bin/env bash
# The README's first command (`make quickstart`) runs this, on CPU, with nothing from outside the repository:
#   1. train a SentencePiece BPE tokenizer on the bundled King James Bible sample,
#   2. preprocess the sample into Megatron's .bin/.idx format,
#   3. train a small GPT with tensor parallelism 2 x ZeRO-2 data parallelism 2 (4 processes),
#      evaluating as it goes, logging to TensorBoard (runs/quickstart) and checkpointing (checkpoints/quickstart),
#   4. sample a few lines from the trained model with tools/generate.py (KV cache; loaded here at TP 1).
# Sized to finish in about 3 minutes on 2 cores without AVX-512 (docs/quickstart.md):
# 64-token windows in 2 micro-batches of 8 per rank, 150 iterations.
# Usage: bash examples/quickstart.sh [python]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
export OMP_NUM_THREADS=1
mkdir -p data
if [ ! -f data/kjv_tok.model ]; then
    "$PY" tools/train_tokenizer.py --input data_sample/kjv_sample.jsonl.gz --vocab-size 4000 \
        --output-prefix data/kjv_tok
fi
if [ ! -f data/kjv_text_document.idx ]; then
    "$PY" tools/preprocess_data.py --input data_sample/kjv_sample.jsonl.gz --output-prefix data/kjv \
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model data/kjv_tok.model --append-eod --workers 2
fi
"$PY" -m torch.distributed.run --standalone --nproc_per_node 4 pretrain_gpt.py \
    --tensor-model-parallel-size 2 --zero-stage 2 \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 64 \
    --micro-batch-size 8 --global-batch-size 32 --train-iters 150 \
    --lr 2e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 15 \
    --data-path data/kjv_text_document --split 949,50,1 \
    --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model data/kjv_tok.model \
    --log-interval 10 --eval-interval 50 --eval-iters 5 \
    --tensorboard-dir runs/quickstart --save checkpoints/quickstart --save-interval 75 \
    --overwrite-checkpoints  # each quickstart trains from scratch, over the previous quickstart's checkpoints
echo
echo "Samples from the trained model (tools/generate.py; docs/trained-model.md):"
echo
"$PY" tools/generate.py --load checkpoints/quickstart --max-new-tokens 40 --temperature 0.8 --top-k 40 --seed 1234 \
    --prompt "In the beginning" --prompt "And the LORD said unto Moses," --prompt "Blessed are"
