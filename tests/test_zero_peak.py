"""ZeRO stage 3 at its peak: the in-step high-water mark of model-state bytes (shards plus the units gathered
and the gradient buckets in flight, counted as they come and go) equals the shards' formula plus the working
set the schedule keeps ((p + g)(R + 2L) with three or more layers), for the GPT (3 layers) and for a plain
torch.nn model (2 layers); between forward and
backward a rank holds only its shards; at DP 1 nothing is held twice."""

import pytest
import torch

from mpzero.models import GPTConfig, GPTModel
from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import seed_everything
from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer
from tests.distributed import run_ranks
from tests.zero_toy import make_batches, make_model

BYTES = {"fp32": (4, 4), "bf16": (2, 4)}  # (parameter, gradient) bytes per element
GPT = GPTConfig(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=200, max_position_embeddings=16,
                hidden_dropout=0.0, attention_dropout=0.0)


def _padded(numel: int, n: int) -> int:
    return -(-numel // n) * n


def _root_and_layer(model) -> tuple[int, int, int]:
    """(R, L, layers) counted here: trainable elements outside the layers, of one layer, and the layer count."""
    trainable = [(name, p.numel()) for name, p in model.named_parameters() if p.requires_grad]
    root = sum(n for name, n in trainable if not name.startswith("layers."))
    layer = sum(n for name, n in trainable if name.startswith("layers.0."))
    return root, layer, len(model.layers)


def _working_set(p, g, root, layer, layers):
    """What backward holds beyond the shards, worked out by hand from the schedule: the root gathered and its
    gradient bucket; at a middle layer that layer and the prefetched one gathered, its bucket and the
    previous layer's in flight: 2p + 2g per L. With two layers the first has no bucket in flight and the
    second nothing to prefetch: max(2p + g, p + 2g)."""
    per_layer = {1: p + g, 2: max(2 * p + g, p + 2 * g)}.get(layers, 2 * p + 2 * g)
    return (p + g) * root + per_layer * layer


def _gpt():
    groups = init_parallel(1)
    return groups, GPTModel(GPT, groups.tp, seed_everything(1, 0, groups.device))


def _toy():
    return init_parallel(1), make_model()


def _batch(model, groups, step):
    if isinstance(model, GPTModel):
        tokens = torch.randint(0, GPT.vocab_size, (2, 17), generator=torch.Generator().manual_seed(step))
        return model(tokens[:, :-1], tokens[:, 1:]).mean()
    tokens, labels = make_batches(step + 1, 1, groups.dp_size)[step][0][groups.dp_rank]
    return model(tokens, labels).mean()


def _peak(build, dtype):
    groups, model = build()
    precision = PrecisionConfig(dtype)
    model.to(precision.torch_dtype)
    expected_units = _root_and_layer(model)
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=3), AdamConfig(), precision)
    between = []
    for step in range(2):
        loss = _batch(model, groups, step)
        between.append(opt.stage.meter.current)  # after forward, before backward
        opt.backward(loss, last_micro_batch=True)
        opt.step()
    return opt.memory_report(), expected_units, between


@pytest.mark.parametrize("build", [_gpt, _toy], ids=["gpt", "plain-module"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("n", [2, 4])
def test_stage3_peak_is_the_shards_plus_the_stated_working_set(build, dtype, n):
    p, g = BYTES[dtype]
    for report, (root, layer, layers), between in run_ranks(n, _peak, build, dtype):
        working_set = _working_set(p, g, _padded(root, n), _padded(layer, n), layers)
        assert report.peak is not None, report.line()
        assert report.peak.measured == report.measured + working_set, report.line()
        assert report.peak.ratio == pytest.approx(1.0, abs=0.02), report.line()
        assert between == [0, 0]  # between forward and backward: the shards only, the root released too


def _stage3_at_dp1():
    groups, model = _gpt()
    return ZeroOptimizer(model, groups, ZeroConfig(stage=3), AdamConfig(), PrecisionConfig()).memory_report()


def test_stage3_at_dp1_holds_one_copy_of_the_parameters():
    report = run_ranks(1, _stage3_at_dp1)[0]
    assert report.ratio == pytest.approx(1.0, abs=1e-6), report.line()  # 16P: no second, gathered copy
