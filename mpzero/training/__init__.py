"""Pieces of the training loop that `pretrain_gpt.py` composes: batch order, mock data, the LR schedule,
console lines, TensorBoard, peak memory, and SIGTERM handling."""
