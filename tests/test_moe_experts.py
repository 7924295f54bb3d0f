"""The stacked experts (mpzero/moe/experts.py): the grouped GEMM against the per-expert loop (same numbers, an expert
with no rows included), each against a plain MLP per expert written here; and the initial weights drawn expert by
expert from their global names, so an expert-parallel rank's stack is the slice of one process's."""

import pytest
import torch
import torch.nn.functional as F

from mpzero.comm import CommGroup
from mpzero.deferred_init import materialize_module, name_parameters
from mpzero.models.blocks import normal_init
from mpzero.moe import GroupedExperts, experts_impl
from mpzero.moe.experts import _GROUPED_MM

ONE = CommGroup(None, (0,), 0)
H, F_, E = 8, 12, 4


def _experts(experts=range(E), gated=True, bias=False, grouped=False, etp=ONE):
    module = GroupedExperts(H, F_, experts, etp, normal_init(0.5), normal_init(0.5), activation=F.silu,
                            gated=gated, bias=bias, grouped_gemm=grouped)
    name_parameters(module, seed=3)
    materialize_module(module)
    if bias:  # nonzero biases, so their rows are checked too
        with torch.no_grad():
            module.bias1.normal_(generator=torch.Generator().manual_seed(1))
            module.bias2.normal_(generator=torch.Generator().manual_seed(2))
    return module


def _reference(module: GroupedExperts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each expert's MLP on its rows, from its own weight matrices."""
    outs = []
    for e, rows in enumerate(x.split(counts)):
        hidden = rows @ module.weight1[e].t() + (module.bias1[e] if module.bias1 is not None else 0)
        if module.gated:
            gate, up = hidden.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = F.silu(hidden)
        outs.append(hidden @ module.weight2[e].t() + (module.bias2[e] if module.bias2 is not None else 0))
    return torch.cat(outs)


@pytest.mark.parametrize("gated,bias", [(True, False), (False, True)], ids=["swiglu", "gelu-bias"])
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 0, 7], [0, 0, 0, 0]], ids=["one-empty", "one-full",
                                                                                    "no-rows"])
def test_loop_matches_a_plain_mlp_per_expert(gated, bias, counts):
    module = _experts(gated=gated, bias=bias)
    x = torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(0), requires_grad=True)
    out = module(x, counts)
    # an ulp apart at most: the activation runs over all experts' rows at once (SIMD lanes vs tail differ)
    torch.testing.assert_close(out, _reference(module, x, counts), rtol=1e-6, atol=1e-6)
    if sum(counts):
        out.square().sum().backward()
        assert module.weight1.grad[[e for e, c in enumerate(counts) if c == 0]].abs().sum() == 0


@pytest.mark.skipif(_GROUPED_MM is None, reason="this torch has no torch._grouped_mm")
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [1, 1, 1, 1]])
def test_grouped_gemm_matches_the_loop(counts):
    """One torch._grouped_mm per matrix against one matmul per expert, forward and every gradient. Tolerance: the
    grouped kernel may sum the inner products in another order (fp32, a few ulps)."""
    loop, grouped = _experts(grouped=False), _experts(grouped=True)
    x = torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(0))
    x_loop, x_grouped = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_loop, out_grouped = loop(x_loop, counts), grouped(x_grouped, counts)
    torch.testing.assert_close(out_grouped, out_loop, rtol=1e-6, atol=1e-6)
    out_loop.square().sum().backward()
    out_grouped.square().sum().backward()
    for a, b in ((x_grouped.grad, x_loop.grad), (grouped.weight1.grad, loop.weight1.grad),
                 (grouped.weight2.grad, loop.weight2.grad)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_fused_ops_line_names_what_runs():
    assert experts_impl(False) == "loop"
    assert experts_impl(True) == ("grouped_mm" if _GROUPED_MM is not None else
                                  "loop (this torch has no torch._grouped_mm)")


@pytest.mark.parametrize("ep", [2, 4])
def test_an_expert_parallel_ranks_stack_is_one_processs_slice(ep):
    """Expert e is drawn from (seed, layers...experts.e.weight1) wherever it lives: the EP ranks' stacks
    concatenated are one process's, bit for bit."""
    whole = _experts(bias=True)
    local = E // ep
    parts = [_experts(range(r * local, (r + 1) * local), bias=True) for r in range(ep)]
    for name in ("weight1", "weight2"):
        assert torch.equal(torch.cat([getattr(p, name) for p in parts]), getattr(whole, name))
    assert whole.weight1.shape == (E, 2 * F_, H) and whole.weight2.shape == (E, H, F_)


def test_expert_tensor_parallel_ranks_hold_their_slices_of_each_expert():
    """At expert-TP 2 each rank holds [gate_r; up_r] rows of weight1 and the r-th columns of weight2."""
    whole = _experts()
    for r in range(2):
        part = _experts(etp=CommGroup(None, (0, 1), r))
        gate, up = whole.weight1.chunk(2, dim=1)
        half = F_ // 2
        assert torch.equal(part.weight1, torch.cat([gate[:, r * half:(r + 1) * half], up[:, r * half:(r + 1) * half]],
                                                   dim=1))
        assert torch.equal(part.weight2, whole.weight2[:, :, r * half:(r + 1) * half])
