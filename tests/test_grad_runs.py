"""1-D parameters' gradients delivered by runs at stages 0-1 (`mpzero.zero.collector.VectorRun`): held until the last of
a run arrives, then added with one concatenation and one add (stages 2-3 deliver each parameter: the in-step peak
replays when each bucket's full buffer is made). The buffers hold bitwise what one add per parameter leaves; a run
whose member got no gradient is flushed at the end of backward; a GPU launches 2 kernels per run instead of one per
parameter (counted here as the adds into the fp32 buffers). After a step (`zero_()`), the buffers are not zeroed:
the next backward copies each first gradient over the stale values and zeroes the places nobody wrote; at stages
2-3 a bucket's full buffer is made uninitialised and overwritten the same way. Gradients a compiled backward delivers
together (`write_together`) are written a bucket at a time: one foreach copy, or add, per bucket, the same values."""

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import mark_replicated
from mpzero.zero.flat import bucket_layouts
from mpzero.zero.collector import vector_runs
from mpzero.zero.grads import ReplicatedGrads, ShardedGrads
from mpzero.zero.meter import TransientMeter
from tests.distributed import run_ranks
from tests.zero_toy import make_batches, make_model


def _layouts(model, bucket_numel=10 ** 9):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return bucket_layouts(named, bucket_numel, 1, 0)


def test_a_run_is_every_1d_parameter_of_a_bucket_side_by_side():
    model = make_model(num_layers=3)
    (layout,) = _layouts(model)
    (run,) = vector_runs(layout, 0)
    vectors = [p for p in layout.params if p.dim() == 1]
    assert list(run.params) == vectors and len(vectors) == 3 * 4 + 2  # per block: norm w, b, fc1 b, fc2 b; final norm
    assert run.end - run.start == sum(p.numel() for p in vectors) and run.end == layout.numel


class _WritesIntoFp32(TorchDispatchMode):
    """Counts in-place writes into fp32 tensors by op (the collector's; autograd's own sums are in the bf16 model's
    dtype)."""

    def __init__(self):
        super().__init__()
        self.writes = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        target = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]  # a foreach op's first tensor
        if name in ("add_", "copy_", "zero_", "fill_", "_foreach_copy_", "_foreach_add_") and (
                target.dtype == torch.float32):
            self.writes[name] = self.writes.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _collect(model, layouts, grads, batches, writes=None):
    """Backward of each micro-batch through `grads`, ended as the stage ends it; returns the number of adds into its
    fp32 buffers (and each micro-batch's writes by op into `writes`, a list, if given)."""
    adds = 0
    for m, micro in enumerate(batches):
        tokens, labels = micro[0]
        loss = model(tokens, labels).mean() / len(batches)
        counter = _WritesIntoFp32()
        grads.begin_backward(last_micro_batch=m == len(batches) - 1)
        with counter:
            loss.backward()
            grads.end_backward()
        adds += counter.writes.get("add_", 0)
        if writes is not None:
            writes.append(counter.writes)
    return adds


def _per_parameter_sums(model, layouts, batches):
    """What one add per parameter and micro-batch leaves in fp32 buffers, in the same order."""
    flats = [torch.zeros(layout.padded_numel) for layout in layouts]
    places = [(flat, layout, i) for flat, layout in zip(flats, layouts) for i in range(len(layout.params))]
    for micro in batches:
        tokens, labels = micro[0]
        loss = model(tokens, labels).mean() / len(batches)
        grads = torch.autograd.grad(loss, [layout.params[i] for _, layout, i in places])
        for (flat, layout, i), grad in zip(places, grads):
            layout.param_view(flat, i).view(-1).add_(grad.reshape(-1))
    return flats


def test_the_buffers_are_bitwise_those_of_one_add_per_parameter_at_stages_0_to_3():
    run_ranks(1, _bitwise_at_stages_0_to_3)  # a world of one in its own process (the DP group)


def _bf16_model():
    """(2 micro-batches, a bf16 toy model, its layouts in several buckets, each with its own run)."""
    model = make_model(num_layers=2).to(torch.bfloat16)
    return make_batches(1, 2, 1)[0], model, _layouts(model, bucket_numel=300)


def _grads(layouts, sharded: bool):
    """Stage 2-3's gradient buckets (`sharded`) or stage 0-1's, fp32, at DP 1."""
    dp = init_parallel(1).dp
    if sharded:
        return ShardedGrads(layouts, dp, torch.float32, "cpu", True, TransientMeter())
    return ReplicatedGrads(layouts, dp, torch.float32, "cpu", True, "all_reduce")


def _bitwise_at_stages_0_to_3():  # stages 2-3 (ShardedGrads) deliver each parameter: the same sums
    for sharded in (False, True):
        batches, model, layouts = _bf16_model()
        grads = _grads(layouts, sharded)
        adds = _collect(model, layouts, grads, batches)
        got = grads.shards if sharded else grads.flats
        assert all(torch.equal(g, w) for g, w in zip(got, _per_parameter_sums(model, layouts, batches)))
        if sharded:
            continue  # its later micro-batches also add reduced slices into the shards
        runs = [run for b, layout in enumerate(layouts) for run in vector_runs(layout, b)]
        params = [p for layout in layouts for p in layout.params]
        in_runs = sum(len(run.params) for run in runs)
        assert len(runs) >= 2 and in_runs > len(runs)
        # per micro-batch: one add per run and one per parameter outside the runs
        assert adds == 2 * (len(runs) + len(params) - in_runs)


def test_after_a_step_the_buffers_are_overwritten_not_zeroed_then_added_to():
    run_ranks(1, _overwritten)


def _overwritten():
    batches, model, layouts = _bf16_model()
    grads = ReplicatedGrads(layouts, init_parallel(1).dp, torch.float32, "cpu", True, "all_reduce")
    _collect(model, layouts, grads, batches)  # a first step's gradients, then values no gradient has
    for flat in grads.flats:
        flat.fill_(float("nan"))
    counter = _WritesIntoFp32()
    with counter:
        grads.zero_()
    assert counter.writes == {}  # no pass over the buffers
    writes = []
    _collect(model, layouts, grads, batches, writes)
    assert all(torch.equal(g, w) for g, w in zip(grads.flats, _per_parameter_sums(model, layouts, batches)))
    runs = [run for b, layout in enumerate(layouts) for run in vector_runs(layout, b)]
    alone = sum(len(layout.params) for layout in layouts) - sum(len(run.params) for run in runs)
    assert writes == [{"copy_": len(runs) + alone}, {"add_": len(runs) + alone}]  # the first micro-batch copies


class _StaleEmpty(TorchDispatchMode):
    """fp32 tensors made uninitialised (torch.empty) come out full of NaN: what a buffer holds before it is written
    is visible in the results."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.empty.memory_format and out.dtype == torch.float32:
            out.fill_(float("nan"))
        return out


def test_a_full_bucket_buffer_is_made_uninitialised_and_overwritten_at_stages_2_3():
    run_ranks(1, _full_buffers_overwritten)


def _full_buffers_overwritten():
    batches, model, layouts = _bf16_model()
    grads = ShardedGrads(layouts, init_parallel(1).dp, torch.float32, "cpu", True, TransientMeter())
    writes = []
    with _StaleEmpty():
        _collect(model, layouts, grads, batches, writes)
    assert all(torch.equal(g, w) for g, w in zip(grads.shards, _per_parameter_sums(model, layouts, batches)))
    params = sum(len(layout.params) for layout in layouts)
    buckets = len(layouts)  # each reduction at DP 1 is a copy of the full buffer into the shard (or a temporary)
    assert writes[0] == {"copy_": params + buckets}  # a copy per gradient and no zeroing pass
    assert writes[1] == {"copy_": params + buckets, "add_": buckets}  # the second adds its reduced slice


class _UnusedBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.bias = nn.Parameter(torch.randn(4))
        self.scale = nn.Parameter(torch.randn(4))
        self.unused = nn.Parameter(torch.randn(4))  # a run member that receives no gradient

    def forward(self, x):
        return ((x @ self.weight.t() + self.bias) * self.scale).sum()


def test_a_run_with_a_member_that_got_no_gradient_is_flushed_at_the_end_of_backward():
    run_ranks(1, _flushed)


def _flushed():
    model = mark_replicated(_UnusedBias())
    layouts = _layouts(model)
    (run,) = vector_runs(layouts[0], 0)
    assert len(run.params) == 3
    ready = []
    grads = ReplicatedGrads(layouts, init_parallel(1).dp, torch.float32, "cpu", True, "all_reduce")
    grads.collector._on_ready = ready.append  # the bucket never completes: `unused` has no gradient
    x = torch.randn(3, 4)
    grads.begin_backward(last_micro_batch=True)
    model(x).backward()
    grads.end_backward()
    expected = torch.autograd.grad(model(x), [model.bias, model.scale])
    layout = layouts[0]
    index = {name: i for i, name in enumerate(layout.names)}
    for name, grad in zip(("bias", "scale"), expected):
        assert torch.equal(layout.param_view(grads.flats[0], index[name]), grad)
    assert torch.equal(layout.param_view(grads.flats[0], index["unused"]), torch.zeros(4))
    assert ready == [] and model.bias.grad is None and model.scale.grad is None
    grads.flats[0].fill_(float("nan"))  # stale values after a step: overwritten, and zeroed where nobody wrote
    grads.zero_()
    grads.begin_backward(last_micro_batch=True)
    model(x).backward()
    grads.end_backward()
    for name, grad in zip(("bias", "scale"), expected):
        assert torch.equal(layout.param_view(grads.flats[0], index[name]), grad)
    assert torch.equal(layout.param_view(grads.flats[0], index["unused"]), torch.zeros(4))
    (weight_grad,) = torch.autograd.grad(model(x), model.weight)
    assert torch.equal(layout.param_view(grads.flats[0], index["weight"]), weight_grad)


def test_gradients_delivered_together_are_written_a_bucket_at_a_time():
    run_ranks(1, _together)


def _together():
    for sharded in (False, True):
        batches, model, layouts = _bf16_model()
        grads = _grads(layouts, sharded)
        grads.collector.write_together(set(model.parameters()))
        writes = []
        _collect(model, layouts, grads, batches)  # fresh zeroed buffers (stages 0-1) are added to
        grads.zero_()
        _collect(model, layouts, grads, batches, writes)
        got = grads.shards if sharded else grads.flats
        assert all(torch.equal(g, w) for g, w in zip(got, _per_parameter_sums(model, layouts, batches)))
        buckets = len(layouts)
        if sharded:  # each micro-batch's full buffers are new: copied into, then each reduction copies (and adds)
            assert writes == [{"_foreach_copy_": buckets, "copy_": buckets},
                              {"_foreach_copy_": buckets, "copy_": buckets, "add_": buckets}]
        else:  # after a step the first micro-batch copies over the stale values, the second adds
            assert writes == [{"_foreach_copy_": buckets}, {"_foreach_add_": buckets}]
