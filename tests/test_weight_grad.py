"""Zero bubble's deferred weight gradient (mpzero/tensor_parallel/weight_grad.py) against autograd's own."""

import torch
import torch.nn.functional as F

from mpzero.tensor_parallel.weight_grad import WeightGradStore, deferring_linear


def test_a_deferred_weight_gradient_is_autograds_own_in_the_weights_layout():
    """I then W give the weight and bias gradients autograd gives F.linear, bit for bit, and the weight's arrives in
    the weight's own layout, as autograd makes it (a transposed one cost AccumulateGrad a strided copy)."""
    torch.manual_seed(0)
    x = torch.randn(2, 16, 24)
    weight, bias = torch.randn(40, 24), torch.randn(40)
    out_grad = torch.randn(2, 16, 40)

    reference = [t.clone().requires_grad_() for t in (x, weight, bias)]
    F.linear(*reference).backward(out_grad)

    store = WeightGradStore()
    ours = [t.clone().requires_grad_() for t in (x, weight, bias)]
    with store.defer("mb 0"):
        deferring_linear(*ours, store).backward(out_grad)
    assert ours[1].grad is None and store.held_bytes > 0  # I: the input and bias gradients only
    assert torch.equal(ours[0].grad, reference[0].grad) and torch.equal(ours[2].grad, reference[2].grad)

    arriving = []
    ours[1].register_hook(lambda grad: arriving.append(grad.stride()))
    store.run("mb 0")
    assert torch.equal(ours[1].grad, reference[1].grad) and arriving == [weight.stride()]
    assert store.held_bytes == 0 and store.pending() == []
