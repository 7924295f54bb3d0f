"""mpzero as a library (issue 12, items 3 and 4): GPTConfig's options and Megatron's flags for them, a model that
needs no RNG tracker and leaves torch's global RNG alone, the mean loss, the weight-decay rule as an optimizer
parameter, init_parallel's backend, the one-bucket note, and the example that trains a plain torch.nn model under
torchrun (FLOPs against a count of the real ops: tests/test_flops.py)."""

import dataclasses
import math
import contextlib
import io
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpzero.cli.arguments import build_parser, gpt_config, parse_args
from mpzero.errors import ConfigError
from mpzero.models import GPTConfig, GPTModel
from mpzero.models.gpt import transformer_layer
from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import gather_from_tp, gather_full, mark_replicated, seed_everything
from mpzero.training import overlap_note
from mpzero.zero import AdamConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer
from tests.cli import ROOT, TINY, assert_close_lists, exit_code_and_stderr, main_capturing_stdout, quiet_main
from tests.distributed import run_ranks

sys.path.insert(0, os.path.join(ROOT, "examples"))
import train_plain_module  # noqa: E402

NO_DROPOUT = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=203,
                       max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)


def _tokens(seed=1, batch=2, seq=9, vocab=203):
    return torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))


# -- GPTConfig and the flags ----------------------------------------------------------------------

def test_dropout_defaults_are_megatrons_in_the_flags_and_the_dataclass():
    defaults = build_parser().parse_args([])
    assert defaults.hidden_dropout == GPTConfig.hidden_dropout == 0.1
    assert defaults.attention_dropout == GPTConfig.attention_dropout == 0.1


def test_untie_and_openai_gelu_flags_reach_the_config_and_its_architecture():
    argv = TINY + ["--untie-embeddings-and-output-weights", "--openai-gelu", "--seed", "77"]
    config = gpt_config(parse_args(argv), 300)
    assert config.untie_embeddings_and_output_weights and config.openai_gelu and config.init_seed == 77
    arch = config.architecture()
    assert arch["untie_embeddings_and_output_weights"] is True and arch["openai_gelu"] is True
    plain = gpt_config(parse_args(TINY), 300).architecture()
    assert plain["untie_embeddings_and_output_weights"] is False and plain["openai_gelu"] is False


def test_a_checkpoint_is_refused_by_a_run_with_another_gelu(tmp_path):
    save = ["--save", str(tmp_path / "ckpt"), "--train-iters", "1"]
    run_ranks(1, quiet_main, TINY + save)
    code, err = run_ranks(1, exit_code_and_stderr, TINY + save + ["--load", str(tmp_path / "ckpt"), "--openai-gelu",
                                                                  "--train-iters", "2"])[0]
    assert code == 2 and "--openai-gelu" in err and len(err.strip().splitlines()) == 1, err


def _model_outputs(tp_size, config):
    groups = init_parallel(tp_size)
    model = GPTModel(config, groups.tp)
    tokens = _tokens()
    logits = gather_from_tp(model(tokens[:, :-1]), groups.tp)[..., :config.vocab_size]
    loss = model(tokens[:, :-1], tokens[:, 1:], reduction="mean")
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        full = gather_full(p.grad, p.partition_dim, groups.tp)
        grads[name] = full[:config.vocab_size] if p.unpadded_size else full  # real vocabulary rows
    return loss.item(), logits.detach(), grads


def test_untied_output_layer_is_tp_invariant_and_its_own_weight():
    config = dataclasses.replace(NO_DROPOUT, untie_embeddings_and_output_weights=True)
    single = run_ranks(1, _model_outputs, 1, config)[0]
    assert "output_layer.weight" in single[2]
    tied = run_ranks(1, _model_outputs, 1, NO_DROPOUT)[0]
    assert "output_layer.weight" not in tied[2] and abs(tied[0] - single[0]) > 1e-4  # another model
    for loss, logits, grads in run_ranks(2, _model_outputs, 2, config):
        assert abs(loss - single[0]) <= 1e-5 * single[0]
        torch.testing.assert_close(logits, single[1], rtol=1e-5, atol=1e-6)
        for name, grad in single[2].items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_untied_model_trains_like_one_process_at_tp2_dp2_stage3():
    argv = TINY + ["--untie-embeddings-and-output-weights", "--openai-gelu", "--train-iters", "4"]
    reference = run_ranks(1, quiet_main, argv)[0]
    history = run_ranks(4, quiet_main, argv + ["--tensor-model-parallel-size", "2", "--zero-stage", "3"])[0]
    assert_close_lists(history["losses"], reference["losses"])
    assert_close_lists(history["grad_norms"], reference["grad_norms"])


def _activations_alone(x):
    tp = init_parallel(1).tp
    outputs = {}
    for gelu in (False, True):
        layer = transformer_layer(dataclasses.replace(NO_DROPOUT, openai_gelu=gelu), tp, None)
        layer.mlp.fc1 = nn.Identity()  # the activation alone, between identities
        layer.mlp.fc2 = nn.Identity()
        outputs[gelu] = layer.mlp(x)
    return outputs


def test_openai_gelu_is_the_tanh_form():
    x = torch.linspace(-4, 4, 101)
    tanh_form = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    outputs = run_ranks(1, _activations_alone, x)[0]
    torch.testing.assert_close(outputs[True], tanh_form, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(outputs[False], F.gelu(x), rtol=0, atol=0)
    assert (outputs[True] - outputs[False]).abs().max() > 1e-4


# -- building a model: no tracker needed, global RNG untouched -------------------------------------

def _build_twice_under_other_global_seeds():
    tp = init_parallel(1).tp
    weights = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        before = torch.get_rng_state()
        model = GPTModel(NO_DROPOUT, tp)  # no rng: no dropout, no recomputation
        assert torch.equal(torch.get_rng_state(), before), "building the model drew from the global RNG"
        weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
    other_seed = GPTModel(dataclasses.replace(NO_DROPOUT, init_seed=99), tp, seed_everything(5, 0, torch.device("cpu")))
    return weights, {n: p.detach().clone() for n, p in other_seed.named_parameters()}


def test_model_init_is_its_own_generator_not_the_global_rng():
    (first, second), other_seed = run_ranks(1, _build_twice_under_other_global_seeds)[0]
    for name in first:
        assert torch.equal(first[name], second[name]), name
    assert not torch.equal(first["layers.0.mlp.fc1.weight"], other_seed["layers.0.mlp.fc1.weight"])


def _refusal_without_a_tracker(change):
    with pytest.raises(ConfigError, match="needs an RNG tracker") as error:
        GPTModel(dataclasses.replace(NO_DROPOUT, **change), init_parallel(1).tp)
    return str(error.value)


@pytest.mark.parametrize("change", [dict(hidden_dropout=0.1), dict(attention_dropout=0.1),
                                    dict(recompute_activations=True)])
def test_dropout_or_recomputation_without_a_tracker_is_one_line(change):
    assert "\n" not in run_ranks(1, _refusal_without_a_tracker, change)[0]


def _per_token_and_mean_losses():
    model = GPTModel(NO_DROPOUT, init_parallel(1).tp)
    tokens = _tokens()
    per_token = model(tokens[:, :-1], tokens[:, 1:])
    with pytest.raises(ConfigError, match="reduction 'sum' is not one of none, mean"):
        model(tokens[:, :-1], tokens[:, 1:], reduction="sum")
    return per_token, model(tokens[:, :-1], tokens[:, 1:], reduction="mean")


def test_mean_reduction_is_the_mean_of_the_per_token_losses():
    per_token, mean = run_ranks(1, _per_token_and_mean_losses)[0]
    assert per_token.shape == (2, 9) and mean.shape == ()
    torch.testing.assert_close(mean, per_token.mean(), rtol=0, atol=0)


# -- the weight-decay rule is the optimizer's parameter ---------------------------------------------

class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 6), nn.LayerNorm(6)])
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _one_step_without_gradient(stage, decay):
    """With zero gradients AdamW's update is the decay alone: p <- p (1 - lr wd) exactly where it applies."""
    groups = init_parallel(1)
    torch.manual_seed(0)
    model = mark_replicated(_Net())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=stage), AdamConfig(lr=0.5, weight_decay=0.2, impl="torch"),
                        PrecisionConfig(), decay=decay)
    opt.backward((model(torch.ones(2, 6)) * 0.0).sum(), last_micro_batch=True)
    opt.step()
    if stage == 3:  # the full parameters exist only inside forward: read them through the export
        after = opt.consolidated_state_dict()
    else:
        after = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {n: bool(torch.allclose(after[n], before[n] * (1 - 0.5 * 0.2), rtol=1e-6, atol=0)
                    and not torch.equal(after[n], before[n])) if before[n].abs().sum() > 0 else None
            for n in before}, {n: torch.equal(after[n], before[n]) for n in before}


def _the_head_decays(name, param):
    return name.startswith("head.")


def _decay_says_one(name, param):
    return 1


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("decay,expected", [
    (None, {"blocks.0.weight"} | {"head.weight"}),  # Megatron's rule: matrices
    (_the_head_decays, {"head.weight", "head.bias"}),
    ({"blocks.1.weight", "blocks.0.bias"}, {"blocks.1.weight", "blocks.0.bias"}),
])
def test_the_decay_rule_is_an_optimizer_parameter(stage, decay, expected):
    decayed, unchanged = run_ranks(2, _one_step_without_gradient, stage, decay)[0]
    for name in decayed:
        if name in expected:
            assert decayed[name], f"{name} was not decayed"
        elif decayed[name] is not None:  # (a zero bias cannot show decay)
            assert unchanged[name], f"{name} changed without a gradient and without decay"


def _refusal_of_the_decay_rule(decay):
    with pytest.raises(ConfigError) as error:
        ZeroOptimizer(mark_replicated(_Net()), init_parallel(1), ZeroConfig(), AdamConfig(), PrecisionConfig(),
                      decay=decay)
    return str(error.value)


def test_a_bad_decay_rule_is_one_line():
    assert "'head.wieght'" in run_ranks(1, _refusal_of_the_decay_rule, {"head.wieght"})[0]
    assert "returned 1 for parameter" in run_ranks(1, _refusal_of_the_decay_rule, _decay_says_one)[0]
    assert "decay must be None" in run_ranks(1, _refusal_of_the_decay_rule, 3)[0]


# -- init_parallel's backend --------------------------------------------------------------------------

def _backends():
    said = {}
    for backend in ("nccl", "mpi"):
        with pytest.raises(ConfigError) as error:
            init_parallel(1, backend=backend)
        said[backend] = str(error.value)
    assert init_parallel(1, backend="gloo").device == torch.device("cpu")  # the group the harness made
    torch.distributed.destroy_process_group()
    os.environ.pop("WORLD_SIZE", None)
    groups = init_parallel(1)  # default: gloo without CUDA, a world of one
    said["default"] = torch.distributed.get_backend()
    return said, groups.world.size


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU default and the refusal of NCCL without CUDA")
def test_init_parallel_takes_a_backend():
    said, world = run_ranks(1, _backends)[0]
    assert "needs CUDA" in said["nccl"] and "'mpi' is not one of nccl, gloo" in said["mpi"]
    assert said["default"] == "gloo" and world == 1


# -- the note when one bucket holds everything ------------------------------------------------------

@pytest.mark.parametrize("flags,said", [([], True), (["--zero-bucket-numel", "5000"], False),
                                        (["--zero-stage", "3"], False), (["--no-overlap-comm"], False)])
def test_one_bucket_for_all_parameters_is_said_once_at_start(flags, said):
    argv = TINY + ["--train-iters", "1", "--zero-stage", "2"] + flags
    stdout = run_ranks(2, main_capturing_stdout, argv)[0][1]
    assert stdout.count("in one gradient bucket") == (1 if said else 0), stdout


def _stage3_note_of_a_plain_module():
    groups = init_parallel(1)
    plain = mark_replicated(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    return overlap_note(ZeroOptimizer(plain, groups, ZeroConfig(stage=3), AdamConfig(), PrecisionConfig()))


def test_stage3_without_units_is_said():
    assert "no units" in run_ranks(2, _stage3_note_of_a_plain_module)[0]


# -- the example: a plain torch.nn model under torchrun -------------------------------------------------

def test_plain_module_example_under_torchrun_matches_torch_adamw(tmp_path):
    # torchrun's agent makes its log folders under TMPDIR and keeps them: this test's folder, not the system one
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "TMPDIR": str(tmp_path)}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run(torchrun + [os.path.join(ROOT, "examples", "train_plain_module.py"), "--steps", "20",
                                        "--zero-stage", "3"], capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\S+) \| grad norm", result.stdout)]
    assert len(losses) == 20, result.stdout
    reference = run_ranks(1, train_plain_module.train_reference, 20, 32, 1234)[0]
    assert_close_lists(losses, reference)
    assert reference[-1] < 0.5 * reference[0]  # it learns


def _example_memory_line(steps: int) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train_plain_module.main(["--steps", str(steps), "--zero-stage", "3"])
    return next((line for line in out.getvalue().splitlines() if line.startswith("zero memory")), None)  # rank 0


@pytest.mark.parametrize("n", [2, 4])
def test_plain_module_example_stage3_peak_is_at_its_formula(n):
    line = run_ranks(n, _example_memory_line, 2)[0]
    fields = dict(f.strip().rsplit(" ", 1) for f in line.split("|")[1:])
    assert float(fields["ratio"]) == pytest.approx(1.0, abs=0.02), line
    assert float(fields["peak ratio"]) == pytest.approx(1.0, abs=0.02), line
