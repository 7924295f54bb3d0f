"""Each TP layer and the vocab-parallel cross entropy against the dense torch reference, forward and every
gradient, at TP=2 and TP=4 with odd sizes. Tolerance: fp32 sums taken in a different order (all-reduce of
partial products), so a few ulps; 1e-6 absolute/relative."""

import pytest
import torch
import torch.nn.functional as F

from mpzero.deferred_init import materialize_module, name_parameters, parameter_generator
from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                    vocab_parallel_cross_entropy)
from tests.distributed import run_ranks

TOL = dict(rtol=1e-6, atol=1e-6)


def _init(t, generator):
    torch.nn.init.normal_(t, std=0.5, generator=generator)


def _full_weight(shape):
    """The full weight a layer's `weight` holds its slice of: its own generator, keyed by its name."""
    w = torch.empty(shape)
    _init(w, parameter_generator(0, "weight"))
    return w


def _made(layer):
    """A layer built alone holds meta parameters until it is made (`mpzero.deferred_init`)."""
    name_parameters(layer, seed=0)
    materialize_module(layer)
    return layer


def _mine(full, dim, tp):
    return full.chunk(tp.size, dim=dim)[tp.rank]


def _column_parallel_linear_case():
    tp = init_parallel(torch.distributed.get_world_size()).tp
    layer = _made(ColumnParallelLinear(7, 12, tp, _init, gather_output=True))
    w = _full_weight((12, 7)).requires_grad_()
    b = torch.zeros(12, requires_grad=True)
    x = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(1))
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad_out = torch.randn(3, 5, 12, generator=torch.Generator().manual_seed(2))
    ref, out = F.linear(x_ref, w, b), layer(x_tp)
    torch.testing.assert_close(out, ref, **TOL)
    ref.backward(grad_out)
    out.backward(grad_out)
    torch.testing.assert_close(x_tp.grad, x_ref.grad, **TOL)
    torch.testing.assert_close(layer.weight.grad, _mine(w.grad, 0, tp), **TOL)
    torch.testing.assert_close(layer.bias.grad, _mine(b.grad, 0, tp), **TOL)
    assert layer.weight.tensor_parallel and layer.weight.partition_dim == 0


def _row_parallel_linear_case():
    tp = init_parallel(torch.distributed.get_world_size()).tp
    layer = _made(RowParallelLinear(12, 5, tp, _init, input_is_parallel=False))
    w = _full_weight((5, 12)).requires_grad_()
    b = torch.zeros(5, requires_grad=True)
    x = torch.randn(3, 12, generator=torch.Generator().manual_seed(1))
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad_out = torch.randn(3, 5, generator=torch.Generator().manual_seed(2))
    ref, out = F.linear(x_ref, w, b), layer(x_tp)
    torch.testing.assert_close(out, ref, **TOL)
    ref.backward(grad_out)
    out.backward(grad_out)
    torch.testing.assert_close(x_tp.grad, x_ref.grad, **TOL)
    torch.testing.assert_close(layer.weight.grad, _mine(w.grad, 1, tp), **TOL)
    torch.testing.assert_close(layer.bias.grad, b.grad, **TOL)
    assert not layer.bias.tensor_parallel


def _vocab_parallel_embedding_case():
    tp = init_parallel(torch.distributed.get_world_size()).tp
    layer = _made(VocabParallelEmbedding(16, 5, tp, _init))
    w = _full_weight((16, 5)).requires_grad_()
    ids = torch.tensor([[0, 15, 3, 8], [7, 7, 12, 1]])
    grad_out = torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(2))
    ref, out = F.embedding(ids, w), layer(ids)
    torch.testing.assert_close(out, ref, **TOL)
    ref.backward(grad_out)
    out.backward(grad_out)
    torch.testing.assert_close(layer.weight.grad, _mine(w.grad, 0, tp), **TOL)


def _cross_entropy_case():
    tp = init_parallel(torch.distributed.get_world_size()).tp
    logits = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1)) * 4
    target = torch.randint(0, 16, (3, 5), generator=torch.Generator().manual_seed(2))
    full = logits.clone().requires_grad_()
    shard = _mine(logits, -1, tp).clone().requires_grad_()
    ref = F.cross_entropy(full.view(-1, 16), target.view(-1), reduction="none").view(3, 5)
    loss = vocab_parallel_cross_entropy(shard, target, tp)
    torch.testing.assert_close(loss, ref, **TOL)
    weights = torch.rand(3, 5, generator=torch.Generator().manual_seed(3))
    (ref * weights).sum().backward()
    (loss * weights).sum().backward()
    torch.testing.assert_close(shard.grad, _mine(full.grad, -1, tp), **TOL)


CASES = [_column_parallel_linear_case, _row_parallel_linear_case, _vocab_parallel_embedding_case, _cross_entropy_case]


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.strip("_"))
def test_tp_layer_matches_dense_reference(case, tp_size):
    run_ranks(tp_size, case)


def test_tp_layers_at_size_one_match_dense_reference():
    for case in CASES:
        run_ranks(1, case)


def _bf16_cross_entropy_case():
    tp = init_parallel(2).tp
    logits = (torch.randn(4, 16, generator=torch.Generator().manual_seed(1)) * 4).bfloat16()
    target = torch.arange(4) * 4
    ref = F.cross_entropy(logits.float(), target, reduction="none")
    torch.testing.assert_close(vocab_parallel_cross_entropy(_mine(logits, -1, tp), target, tp), ref, **TOL)


def test_cross_entropy_in_bf16_matches_fp32_reference():
    """bf16 logits are upcast inside; the loss is exact for bf16-representable inputs."""
    run_ranks(2, _bf16_cross_entropy_case)
