"""SGD with momentum (`--optimizer sgd`), the second update rule: its step against torch.optim.SGD, ZeRO stages 0-3
against a single-process torch.optim.SGD, the offload tiers against the device, TP x DP layouts against one
process, its memory line (K = 8 in mixed precision), checkpoints of one rule refused by the other, its flags."""

import json

import pytest
import torch

from mpzero.cli.arguments import parse_args, run_config
from mpzero.errors import ConfigError
from mpzero.optim import SGD, AdamW, sgd_reference
from mpzero.parallel import init_parallel
from mpzero.zero import OffloadConfig, OptimizerConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer
from tests.cli import TINY, assert_close_lists, exit_code_and_stderr, main_capturing_stdout, quiet_main
from tests.distributed import run_ranks
from tests.zero_toy import make_batches, make_model, reference_grads

STEPS, MICRO, LR, WD, MOMENTUM = 3, 2, 1e-2, 0.1, 0.9
SGD_RUN = ["--optimizer", "sgd", "--lr", "1e-2"]


def reference_sgd(model, momentum=MOMENTUM):
    """torch's for-loop SGD with Megatron's decay rule: no weight decay for parameters with ndim < 2."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD([{"params": [p for p in params if p.ndim >= 2], "weight_decay": WD},
                            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                           lr=LR, momentum=momentum, foreach=False)


@pytest.mark.parametrize("momentum", [0.9, 0.0])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_sgd_reference_matches_torch_sgd(momentum, weight_decay):
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(1000, generator=gen)
    ours, buf = param.clone(), torch.zeros(1000)
    theirs = torch.nn.Parameter(param.clone())
    opt = torch.optim.SGD([theirs], lr=LR, momentum=momentum, weight_decay=weight_decay, foreach=False)
    for step in range(1, 5):
        grad = torch.randn(1000, generator=gen)
        theirs.grad = grad.clone()
        opt.step()
        sgd_reference(ours, grad, buf, None, LR, momentum, weight_decay, step)
        assert torch.equal(ours, theirs.detach()), step


def _config(momentum=MOMENTUM):
    return OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=0.0, impl="torch", rule=SGD(momentum))


def _train(stage, dtype="fp32", offload=None, momentum=MOMENTUM):
    """Runs on every rank: this rank's consolidated fp32 weights and its memory report after STEPS steps."""
    groups = init_parallel(tp_size=1)
    model = make_model()
    if dtype != "fp32":
        model.to(PrecisionConfig(dtype).torch_dtype)
    opt = ZeroOptimizer(model, groups, ZeroConfig(stage=stage, bucket_numel=150), _config(momentum),
                        PrecisionConfig(dtype), offload=offload)
    try:
        for step_batches in make_batches(STEPS, MICRO, groups.dp_size):
            for m, micro_batch in enumerate(step_batches):
                tokens, labels = micro_batch[groups.dp_rank]
                opt.backward(model(tokens, labels).mean() / MICRO, last_micro_batch=(m == MICRO - 1))
            opt.step()
        return opt.consolidated_state_dict(), opt.memory_report()
    finally:
        opt.close()


@pytest.mark.parametrize("momentum", [MOMENTUM, 0.0])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_matches_torch_sgd(stage, momentum):
    results = run_ranks(2, _train, stage, "fp32", None, momentum)
    model = make_model()
    opt = reference_sgd(model, momentum)
    for step_batches in make_batches(STEPS, MICRO, 2):
        reference_grads(model, step_batches, 2, per_micro_batch=stage >= 2)
        opt.step()
    for weights, _ in results:
        for name, value in model.named_parameters():  # exact: same gradients (a + b commutes), same arithmetic
            assert torch.equal(weights[name], value.detach()), name


@pytest.mark.parametrize("tier", ["cpu", "disk"])
@pytest.mark.parametrize("stage,dtype", [(1, "bf16"), (2, "fp32"), (3, "bf16")])
def test_offload_tiers_equal_the_device(tmp_path, tier, stage, dtype):
    """Sub-groups of 7 elements cut every decay run: the canonical windows keep SGD bit for bit too."""
    offload = OffloadConfig(optimizer=tier, sub_group_numel=7, path=str(tmp_path) if tier == "disk" else None)
    expected = run_ranks(2, _train, stage, dtype)
    offloaded = run_ranks(2, _train, stage, dtype, offload)
    for (ours, _), (theirs, _) in zip(offloaded, expected):
        for name in theirs:
            assert torch.equal(ours[name], theirs[name]), name


@pytest.mark.parametrize("dtype,formula", [("bf16", "6P+8P/N"), ("fp32", "8P+4P/N")])
def test_memory_line_counts_one_momentum_buffer(dtype, formula):
    """K = fp32 master + momentum = 8 bytes per parameter in mixed precision; in fp32 the master is the parameter
    (K = 4); AdamW's are 12 and 8. Stage 1 at DP 2: (p + g) P + K P/N."""
    for _, report in run_ranks(2, _train, 1, dtype):
        assert report.formula_text == formula
        assert report.formula == report.numel * sum(int(t[:-1] if t.endswith("P") else t[:-3]) / d
                                                    for t, d in zip(formula.split("+"), (1, 2)))
        padded = report.measured - report.formula  # padding elements are held too, formula counts none
        assert 0 <= padded <= report.padding * 16, (report.measured, report.formula, report.padding)


@pytest.mark.parametrize("stage", [1, 3])
def test_layout_matches_single_process(stage):
    reference = run_ranks(1, main_capturing_stdout, TINY + SGD_RUN + ["--zero-stage", "0"])[0][0]
    argv = TINY + SGD_RUN + ["--tensor-model-parallel-size", "2", "--zero-stage", str(stage),
                             "--micro-batch-size", "1", "--zero-bucket-numel", "5000"]
    history = run_ranks(4, main_capturing_stdout, argv)[0][0]
    assert_close_lists(history["losses"], reference["losses"])
    assert_close_lists(history["grad_norms"], reference["grad_norms"])
    losses = history["losses"]  # it learns: the last half's mean below the first half's (each batch is noisy)
    assert sum(losses[5:]) < sum(losses[:5])


def test_checkpoint_resumes_bit_exact_and_the_other_rule_is_refused(tmp_path):
    argv = TINY + SGD_RUN + ["--train-iters", "8", "--eval-iters", "0", "--zero-stage", "2"]
    uninterrupted = run_ranks(2, quiet_main, argv)[0]
    first = run_ranks(2, quiet_main, argv + ["--save", str(tmp_path), "--exit-interval", "4"])[0]
    meta = json.loads((tmp_path / "iter_0000004" / "meta.json").read_text())
    assert meta["optimizer"]["rule"] == "sgd"
    assert sorted({k.split("/")[1] for k in meta["shapes"] if k.startswith("optimizer/")}) == ["momentum_buffer"]
    resumed = run_ranks(2, quiet_main, argv + ["--load", str(tmp_path)])[0]
    assert first["losses"] + resumed["losses"] == uninterrupted["losses"]
    adam = [a for a in argv if a != "sgd" and a != "--optimizer"]
    code, stderr = run_ranks(1, exit_code_and_stderr, adam + ["--load", str(tmp_path)])[0]
    assert code == 2 and stderr.count("\n") == 1
    assert "holds --optimizer sgd state, this run is --optimizer adam" in stderr
    code, _ = run_ranks(1, exit_code_and_stderr, adam + ["--load", str(tmp_path), "--no-load-optim"])[0]
    assert code == 0  # the weights alone load under any rule


def test_flags_and_config_file(tmp_path):
    assert run_config(parse_args(TINY), 1).optimizer.rule == AdamW()
    run = run_config(parse_args(TINY + ["--optimizer", "sgd"]), 1)
    assert run.optimizer.rule == SGD(momentum=0.9)  # Megatron's default --sgd-momentum
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"optimizer": "sgd", "sgd-momentum": 0.5}))
    assert run_config(parse_args(TINY + ["--config", str(path)]), 1).optimizer.rule == SGD(momentum=0.5)
    for bad, fragment in ((["--optimizer", "lion"], "--optimizer"), (["--sgd-momentum", "-1"], "--sgd-momentum")):
        with pytest.raises(ConfigError, match=fragment) as error:
            run_config(parse_args(TINY + bad), 1)
        assert "\n" not in str(error.value)
