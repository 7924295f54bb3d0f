"""mpzero.fused.sdpa: whether torch's fused attention kernels take a run's attention, asked of torch itself. On a
CPU its fused kernel (flash) takes fp32 and bf16, GQA, any head size here, and no dropout; the CUDA answers are
tests/gpu/test_gpt_cuda.py's."""

import pytest
import torch

from mpzero.fused import AttentionShape, fused_attention_refusal

CPU = torch.device("cpu")


def _shape(dropout=0.0, dtype=torch.float32, heads=4, kv_heads=4):
    return AttentionShape(heads=heads, kv_heads=kv_heads, head_dim=16, seq_length=32, dtype=dtype, dropout=dropout)


@pytest.mark.parametrize("shape", [_shape(), _shape(dtype=torch.bfloat16), _shape(heads=8, kv_heads=2)],
                         ids=["fp32", "bf16", "gqa"])
def test_the_cpu_kernel_takes_attention_without_dropout(shape):
    assert fused_attention_refusal("flash", shape, CPU) is None


def test_dropout_on_a_cpu_is_refused_with_torchs_reason():
    reason = fused_attention_refusal("flash", _shape(dropout=0.1), CPU)
    assert reason == "Both fused kernels do not support non-zero dropout", reason


@pytest.mark.parametrize("backend", ["local", "unfused"])
def test_explicit_scores_need_no_kernel(backend):
    assert fused_attention_refusal(backend, _shape(dropout=0.1), CPU) is None


def test_fused_asks_for_cudnn_alone():
    # cuDNN runs on CUDA only: the attention flash takes here is refused to fused, with torch's one line
    assert fused_attention_refusal("flash", _shape(), CPU) is None
    reason = fused_attention_refusal("fused", _shape(), CPU)
    assert reason and "\n" not in reason, reason


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_probe_leaves_the_random_numbers_alone(dropout):
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    fused_attention_refusal("flash", _shape(dropout=dropout), CPU)
    assert torch.equal(torch.rand(4), expected)


def test_the_shape_says_what_was_asked():
    assert _shape(heads=8, kv_heads=2, dtype=torch.bfloat16, dropout=0.1).describe() == (
        "8 heads sharing 2 key/value heads of size 16, sequence 32, bfloat16, dropout 0.1")
    assert _shape().describe() == "4 heads of size 16, sequence 32, float32, dropout 0"
