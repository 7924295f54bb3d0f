"""Shared test set-up: one intra-op thread (forked ranks deadlock otherwise) and lazy first-call
costs paid once here, before any rank is forked.

Without a GPU, Triton kernels run under Triton's interpreter: TRITON_INTERPRET must be set before
triton is first imported (its own library functions are decorated then), and the torch.optim warm-up
below already imports it, so it is set first thing here."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)
torch.testing.assert_close(torch.zeros(1), torch.zeros(1))
torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
