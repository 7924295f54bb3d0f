"""Pieces of the training loop that `pretrain_gpt.py` composes: batches, mock data, console lines."""
