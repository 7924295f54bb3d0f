"""GPT forward and backward on CUDA equal the CPU model's (fp32, same weights and tokens).

Variants, named by what runs on the GPU (the CPU model is always the references with local attention): auto
(flash attention and torch's LayerNorm on CUDA, mpzero/fused/impl.py), local attention with the Triton LayerNorm
and softmax, local with the PyTorch references, flash (SDPA) with the references.

Tolerance: per-token losses within 1e-5 relative (+1e-5 absolute); every parameter gradient within 1e-4
relative + 1e-4 x its largest CPU magnitude absolute (TF32 off; the GPU sums in other orders: cuBLAS splits,
the Triton kernels' per-program partials). Also: activation recomputation on CUDA replays the dropout masks
(the RNG states are the CUDA generator's), so it gives the same gradients as storing activations, with SDPA's
dropout (auto) and with the local path's explicit dropout. And --cuda-graph-impl local: the compiled trunk
replayed from CUDA graphs gives the --torch-compile run's losses and launches graphs. And torch's fused attention
kernels take the attention of the models people train, and a run whose attention none takes stops at start.
"""

import dataclasses
import math

import pytest
import torch

from mpzero.comm import CommGroup
from mpzero.fused import AttentionShape, fused_attention_refusal, triton_available
from mpzero.models import GPTConfig, GPTModel
from mpzero.tensor_parallel import seed_everything
from tests.cli import exit_code_and_stderr
from tests.gpu.common import DEVICE, SMALL, assert_matches_cpu, losses_and_grads, needs_cuda

pytestmark = [needs_cuda, pytest.mark.usefixtures("no_tf32")]

CONFIG = GPTConfig(num_layers=2, hidden_size=128, num_attention_heads=4, vocab_size=1000,
                   max_position_embeddings=128, hidden_dropout=0.0, attention_dropout=0.0)


def _one_rank() -> CommGroup:
    return CommGroup(None, (0,), 0)  # size 1: every TP collective is the identity


VARIANTS = {"auto": {}, "local-triton": dict(attention_backend="local", layernorm_impl="triton",
                                             softmax_impl="triton"),
            "local-torch": dict(attention_backend="local", layernorm_impl="torch", softmax_impl="torch"),
            "flash-torch": dict(attention_backend="flash", layernorm_impl="torch", softmax_impl="torch")}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpt_on_cuda_equals_cpu(variant):
    if "triton" in VARIANTS[variant].values() and not triton_available():
        pytest.skip("triton not installed (pip install 'mpzero[triton]')")
    config = dataclasses.replace(CONFIG, **VARIANTS[variant])
    cpu = GPTModel(dataclasses.replace(config, attention_backend="local", layernorm_impl="torch",
                                       softmax_impl="torch"), _one_rank(), seed_everything(5, 0, torch.device("cpu")))
    gpu = GPTModel(config, _one_rank(), seed_everything(5, 0, DEVICE), device=DEVICE)
    gpu.load_state_dict(cpu.state_dict())
    tokens = torch.randint(0, config.vocab_size, (4, 129), generator=torch.Generator().manual_seed(0))
    assert_matches_cpu(losses_and_grads(gpu, tokens.to(DEVICE)), losses_and_grads(cpu, tokens))


@pytest.mark.parametrize("backend", ["auto", "local"])
def test_recompute_on_cuda_replays_dropout_masks(backend):
    config = dataclasses.replace(CONFIG, hidden_dropout=0.1, attention_dropout=0.1, attention_backend=backend)
    trackers = [seed_everything(9, 0, DEVICE) for _ in range(2)]
    stored = GPTModel(config, _one_rank(), trackers[0], device=DEVICE)
    recomputed = GPTModel(dataclasses.replace(config, recompute_activations=True), _one_rank(), trackers[1],
                          device=DEVICE)
    recomputed.load_state_dict(stored.state_dict())
    tokens = torch.randint(0, config.vocab_size, (4, 129), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    start = trackers[0].snapshot()
    results = []
    for model, tracker in zip((stored, recomputed), trackers):
        tracker.restore(start)  # the same default (CUDA) generator and tensor-parallel stream for both
        results.append(losses_and_grads(model, tokens))
    (losses_a, grads_a), (losses_b, grads_b) = results
    assert torch.equal(losses_a, losses_b)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-6, atol=1e-7)
    dropped = stored(tokens[:, :-1], tokens[:, 1:]).detach()
    stored.eval()
    assert not torch.equal(dropped, stored(tokens[:, :-1], tokens[:, 1:]).detach())  # dropout was on


LLAMA_SHAPED = dataclasses.replace(CONFIG, normalization="RMSNorm", swiglu=True, ffn_hidden_size=256,
                                   position_embedding_type="rope", add_position_embedding=False,
                                   group_query_attention=True, num_query_groups=2, add_bias_linear=False,
                                   untie_embeddings_and_output_weights=True, torch_compile=True)


def _zero1_bf16_run(groups, cuda_graph_impl: str, config: GPTConfig = LLAMA_SHAPED) -> tuple[list[float], int | None]:
    """Four ZeRO-1 bf16 steps of `config` (by default the LLaMA-shaped model) built on the meta device and streamed
    by ZeRO (rotary tables start on the host), each over two micro-batches (gradient accumulation: the graphs'
    outputs are overwritten by the next micro-batch's replay, after its backward), an evaluation (no-grad forward,
    eval mode) after the second: (the losses, the CUDA graphs a fifth, profiled step launches; None off CUDA)."""
    from bench.baselines import step_profile
    from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer
    config = dataclasses.replace(config, cuda_graph_impl=cuda_graph_impl)
    model = GPTModel(config, groups.tp, seed_everything(7, 0, groups.device), device="meta")
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=1), AdamConfig(lr=1e-3, clip_grad=1.0),
                        PrecisionConfig("bf16"))
    tokens = torch.randint(0, config.vocab_size, (4, 129), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    micro_batches, losses = [(t[:, :-1], t[:, 1:]) for t in tokens.split(2)], []

    def step():
        opt.zero_grad()
        for i, (inputs, labels) in enumerate(micro_batches):
            loss = model(inputs, labels).mean() / len(micro_batches)
            opt.backward(loss, last_micro_batch=i == len(micro_batches) - 1)
            losses.append(loss.item())
        opt.step(1e-3)
    for i in range(4):
        step()
        if i == 1:
            model.eval()
            with torch.no_grad():
                losses.append(model(*micro_batches[0]).mean().item())
            model.train()
    profiled = step_profile(step, cuda=DEVICE.type == "cuda")
    return losses, profiled.graph_launches


def test_cuda_graphs_replay_the_compiled_trunk(world):
    """--cuda-graph-impl local against --torch-compile on the same steps: the same losses (bf16; within 2e-3
    relative, as another compilation may autotune another launch configuration for a reduction), and a step that
    launches the trunk's forward and backward as CUDA graphs where the other launches none."""
    plain, graphed = _zero1_bf16_run(world, "none"), _zero1_bf16_run(world, "local")
    assert graphed[0] == pytest.approx(plain[0], rel=2e-3), (graphed[0], plain[0])
    if DEVICE.type == "cuda":
        assert plain[1] == 0 and graphed[1] >= 2, (plain[1], graphed[1])


def test_cuda_graphs_train_gpt2_with_dropout(world):
    """GPT-2's default dropouts (0.1) inside the graphed trunk: attention dropout draws from the RNG tracker's
    stream, whose fork runs eagerly between compiled pieces (a graph break), so the trunk replays as more than one
    graph. The steps must run, launch graphs and give finite losses (the masks are inductor's: no equality with
    another run is claimed)."""
    config = dataclasses.replace(CONFIG, hidden_dropout=0.1, attention_dropout=0.1, torch_compile=True)
    losses, graphs = _zero1_bf16_run(world, "local", config)
    assert all(math.isfinite(x) for x in losses), losses
    if DEVICE.type == "cuda":
        assert graphs >= 2, graphs


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA's kernels (a CPU's: tests/fused/test_fused_sdpa.py)")
@pytest.mark.parametrize("shape", [AttentionShape(12, 12, 64, 1024, torch.bfloat16, 0.1),  # GPT-2, its dropout
                                   AttentionShape(12, 12, 64, 1024, torch.float32, 0.0),  # fp32: memory-efficient
                                   AttentionShape(32, 8, 128, 4096, torch.bfloat16, 0.0)],  # LLaMA-3 8B, GQA
                         ids=["gpt2-bf16-dropout", "gpt2-fp32", "llama3-8b-gqa"])
def test_a_fused_attention_kernel_takes_the_models_people_train(shape):
    assert fused_attention_refusal("flash", shape, DEVICE) is None


@pytest.mark.skipif(DEVICE.type != "cuda", reason="a GPU run stops where a CPU run notes (test_attention_backend)")
def test_attention_no_fused_kernel_takes_stops_the_run_at_start():
    """cuDNN's attention takes fp16 and bf16 alone: an fp32 run on --attention-backend fused would otherwise fail
    inside its first forward (and flash's dispatcher would take the math path without a word)."""
    assert fused_attention_refusal("flash", AttentionShape(4, 4, 64, 64, torch.float64, 0.0), DEVICE)
    code, stderr = exit_code_and_stderr(SMALL + ["--train-iters", "1", "--attention-backend", "fused"])
    said = [line for line in stderr.splitlines() if line.startswith("--attention-backend fused: ")]
    assert code != 0 and len(said) == 1, stderr  # one line (torch's own warnings, if any, are not ours to count)
    assert said[0].startswith("--attention-backend fused: none of torch's fused attention kernels runs this run's "
                              "attention on "), said
    assert "4 heads of size 16, sequence 64, float32, dropout 0, per TP rank" in said[0], said
