"""The mixture of experts on CUDA (mpzero/moe): a GPT whose MLPs are routed experts gives the CPU model's losses and
gradients (fp32, same weights and tokens; the tolerance of tests/gpu/test_gpt_cuda.py), and `--moe-grouped-gemm`'s
`torch._grouped_mm` gives the per-expert loop's outputs and gradients on the GPU, an expert with no rows included:
in bf16, where an H100 runs torch's CUTLASS grouped kernel, and in fp32, which torch runs as a loop of matmuls.

Tolerance of the grouped GEMM against the loop, on the largest magnitude of each compared tensor: fp32 1e-5 (cuBLAS
may pick other kernels for the two shapes); bf16 4 ulps (both round each matmul's fp32 sums once, so the hidden
activations may differ by an ulp, which the second matmul sums over the expert's width). An expert given another's
rows or weights is off by the values themselves.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from mpzero.comm import CommGroup
from mpzero.deferred_init import materialize_module, name_parameters
from mpzero.models import GPTConfig, GPTModel
from mpzero.models.blocks import normal_init
from mpzero.moe import GroupedExperts
from mpzero.moe.experts import _GROUPED_MM
from mpzero.tensor_parallel import seed_everything
from tests.gpu.common import DEVICE, assert_matches_cpu, losses_and_grads, needs_cuda

pytestmark = [needs_cuda, pytest.mark.usefixtures("no_tf32")]
ONE = CommGroup(None, (0,), 0)  # size 1: every TP and EP collective is the identity
CONFIG = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512, max_position_embeddings=64,
                   hidden_dropout=0.0, attention_dropout=0.0, num_experts=4, moe_router_topk=2,
                   moe_ffn_hidden_size=128, moe_aux_loss_coeff=1e-2)
H, F_, E = 64, 128, 4  # multiples of 8: the bf16 grouped kernel's alignment


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped_mm"])
def test_moe_gpt_on_cuda_equals_cpu(grouped):
    config = dataclasses.replace(CONFIG, moe_grouped_gemm=grouped)
    cpu = GPTModel(dataclasses.replace(config, moe_grouped_gemm=False), ONE, seed_everything(5, 0, torch.device("cpu")))
    gpu = GPTModel(config, ONE, seed_everything(5, 0, DEVICE), device=DEVICE)
    gpu.load_state_dict(cpu.state_dict())
    tokens = torch.randint(0, config.vocab_size, (4, 65), generator=torch.Generator().manual_seed(0))
    want = losses_and_grads(cpu, tokens)
    assert any(".experts." in name for name in want[1])
    assert_matches_cpu(losses_and_grads(gpu, tokens.to(DEVICE)), want)


def _experts(grouped: bool, dtype: torch.dtype) -> GroupedExperts:
    module = GroupedExperts(H, F_, range(E), ONE, normal_init(0.5), normal_init(0.5), activation=F.silu, gated=True,
                            bias=False, grouped_gemm=grouped)
    name_parameters(module, seed=3)
    materialize_module(module, DEVICE)
    return module.to(dtype)


@pytest.mark.skipif(_GROUPED_MM is None, reason="this torch has no torch._grouped_mm")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("counts", [[24, 0, 40, 16], [8, 8, 8, 8]], ids=["one-empty", "even"])
def test_grouped_mm_on_cuda_equals_the_loop(dtype, counts):
    loop, grouped = _experts(False, dtype), _experts(True, dtype)
    x = torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(0)).to(DEVICE, dtype)
    x_loop, x_grouped = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_loop, out_grouped = loop(x_loop, counts), grouped(x_grouped, counts)
    out_loop.float().square().sum().backward()
    out_grouped.float().square().sum().backward()
    for name, got, want in (("output", out_grouped, out_loop), ("input grad", x_grouped.grad, x_loop.grad),
                            ("weight1 grad", grouped.weight1.grad, loop.weight1.grad),
                            ("weight2 grad", grouped.weight2.grad, loop.weight2.grad)):
        largest = want.float().abs().max().item()
        tol = dict(rtol=1e-5, atol=1e-5 * largest) if dtype == torch.float32 else dict(
            rtol=0, atol=4 * torch.finfo(dtype).eps * largest)
        torch.testing.assert_close(got.float(), want.float(), **tol, msg=lambda m, name=name: f"{name}: {m}")
    if counts[1] == 0:  # no rows: no gradient
        assert grouped.weight1.grad[1].abs().sum() == 0 and grouped.weight2.grad[1].abs().sum() == 0
