"""Memory planning from the code's own layouts and formulas: `plan_memory.py` (layouts, bytes per rank, cost) and
`pretrain_gpt.py --dry-run` (the real code on fake tensors) share it."""
