#!/usr/bin/env bash
# The README's first command (`make quickstart`) runs this: a small GPT trained on CPU with
# tensor parallelism 2 x data parallelism 2 (4 processes).
# Usage: bash examples/quickstart.sh [python]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
export OMP_NUM_THREADS=1
"$PY" -m torch.distributed.run --standalone --nproc_per_node 4 pretrain_gpt.py \
    --tensor-model-parallel-size 2 \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 64 \
    --micro-batch-size 4 --global-batch-size 32 --train-iters 200 --lr 3e-4 \
    --mock-data --vocab-size 1000 --log-interval 10
