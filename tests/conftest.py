"""Shared test set-up: one intra-op thread (forked ranks deadlock otherwise) and lazy first-call
costs paid once here, before any rank is forked."""

import torch

torch.set_num_threads(1)
torch.testing.assert_close(torch.zeros(1), torch.zeros(1))
torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
