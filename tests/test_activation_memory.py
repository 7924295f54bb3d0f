"""Activation bytes counted with saved-tensor hooks equal the formula (mpzero/activations/formula.py) to the byte:
every recomputation mode, with and without sequence parallelism and distributed checkpoints, at TP 1 and 2,
fp32 and bf16, dropout on and off, GPT-2 and the LLaMA family; per layer and for the whole micro-batch. The formula's paper terms are
Korthikanti et al.'s Table 2; the training run prints one line per rank with ratio 1.0000."""

import dataclasses
import re
from fractions import Fraction

import pytest
import torch

from mpzero.activations import SavedBytesCounter, activation_formula, layer_formula, paper_row
from mpzero.activations.formula import CPU_RNG_STATE_BYTES, ActivationSetting, modeled
from mpzero.cli.arguments import parse_args, run_config
from mpzero.errors import ConfigError
from mpzero.models import GPTConfig, GPTModel
from mpzero.parallel import init_parallel
from mpzero.tensor_parallel import seed_everything
from tests.cli import TINY, exit_code_and_stderr, main_capturing_stdout
from tests.distributed import run_ranks

BASE = GPTConfig(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=300, max_position_embeddings=16,
                 seq_length=16, attention_backend="local")  # Megatron's core attention unless a mode says otherwise
FULL = dict(recompute_granularity="full")
LLAMA = dict(normalization="RMSNorm", swiglu=True, ffn_hidden_size=48, position_embedding_type="rope",
             group_query_attention=True, num_query_groups=2, add_bias_linear=False,
             untie_embeddings_and_output_weights=True)
MODES = {
    "none": {}, "selective": dict(recompute_activations=True), "full uniform 1": FULL,
    "full uniform 2": dict(FULL, recompute_method="uniform", recompute_num_layers=2),
    "full block 2": dict(FULL, recompute_method="block", recompute_num_layers=2),
    "sp": dict(sequence_parallel=True), "sp selective": dict(sequence_parallel=True, recompute_activations=True),
    "sp full": dict(FULL, sequence_parallel=True), "distributed": dict(FULL, distribute_saved_activations=True),
    "distributed uniform 2": dict(FULL, recompute_num_layers=2, distribute_saved_activations=True),
    "untied, tanh GELU": dict(untie_embeddings_and_output_weights=True, openai_gelu=True),
    "sp untied": dict(sequence_parallel=True, untie_embeddings_and_output_weights=True),
    "logits path": dict(cross_entropy_chunk_size=0), "sp, loss in chunks of 5": dict(sequence_parallel=True,
                                                                                    cross_entropy_chunk_size=5),
    # SDPA's CPU flash kernel; with attention dropout the CPU runs SDPA's math fallback (not modeled)
    "flash": dict(attention_backend="flash", attention_dropout=0.0),
    "flash selective": dict(attention_backend="flash", recompute_activations=True),
    "sp flash": dict(attention_backend="flash", attention_dropout=0.0, sequence_parallel=True),
    "unfused": dict(attention_backend="unfused"),
    "auto": dict(attention_backend="auto"),  # the CPU's choice: flash without attention dropout, local with it
    # the LLaMA family: RMSNorm, SwiGLU, RoPE, 4 heads in 2 query groups, no biases, untied output
    "llama": LLAMA, "llama selective": dict(LLAMA, recompute_activations=True),
    "llama flash": dict(LLAMA, attention_backend="flash", attention_dropout=0.0),
    "llama full": dict(LLAMA, **FULL), "llama sp selective": dict(LLAMA, sequence_parallel=True,
                                                                  recompute_activations=True),
}
TP2_ONLY = ("sp", "sp selective", "sp full", "distributed", "distributed uniform 2", "sp untied",
            "sp, loss in chunks of 5", "sp flash", "llama sp selective")


def _count(groups, config, dtype, batch=2, seq=16):
    """Per-layer and whole-micro-batch bytes, counted on a training forward and by formula."""
    model = GPTModel(config, groups.tp, seed_everything(3, groups.tp_rank, groups.device)).to(dtype)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    counter = SavedBytesCounter(model)
    with counter.counting():
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()  # inputs and labels: views of one batch, as in training
    loss.backward()
    formula = activation_formula(model.activation_setting(batch, seq, dtype, groups.device))
    return (counter.layer_bytes(config.num_layers), counter.total_bytes,
            formula.layer_bytes, formula.micro_batch_bytes)


def _count_every_mode(tp):
    groups = init_parallel(tp)
    results = {}
    for mode, change in MODES.items():
        if tp == 1 and mode in TP2_ONLY:
            continue
        for dtype in (torch.float32, torch.bfloat16):
            for dropout in (0.0, 0.1):
                config = dataclasses.replace(BASE, **{"hidden_dropout": dropout, "attention_dropout": dropout, **change})
                results[mode, str(dtype), dropout] = _count(groups, config, dtype)
    if tp > 1:  # a micro-batch of one without dropout: the first layer's input, a sequence chunk, is a view that is
        for mode in ("sp", "sp flash", "llama sp selective"):  # contiguous; it must still be a copy of its own
            config = dataclasses.replace(BASE, **{"hidden_dropout": 0.0, "attention_dropout": 0.0, **MODES[mode]})
            results[mode, "batch 1"] = _count(groups, config, torch.float32, batch=1)
    return results


@pytest.mark.parametrize("tp", [1, 2])
def test_counted_bytes_equal_the_formula_in_every_mode(tp):
    for rank, results in enumerate(run_ranks(tp, _count_every_mode, tp)):
        assert len(results) == (60 if tp == 1 else 99)
        for key, (layers, total, formula_layers, formula_total) in results.items():
            assert layers == formula_layers, (rank, key)
            assert total == formula_total, (rank, key)


def _setting(**change):
    base = dict(seq_length=2048, micro_batch_size=1, hidden_size=6144, num_attention_heads=64, num_layers=48,
                vocab_size=51200, padded_vocab_size=51200, tp=8, dtype_bytes=2, mask_bytes=1)
    return ActivationSetting(**{**base, **change})


def test_paper_terms_are_korthikanti_table_2():
    """22B (Korthikanti Table 3): the paper terms of every mode equal Table 2's row, written as Table 2 writes it."""
    s, b, h, a, t = 2048, 1, 6144, 64, Fraction(8)
    sbh = s * b * h
    rows = [({}, "sbh(10 + 24/t + 5as/(ht))", sbh * (10 + 24 / t + 5 * a * s / (h * t))),
            (dict(sequence_parallel=True), "sbh(34/t + 5as/(ht))", sbh * (34 / t + 5 * a * s / (h * t))),
            (dict(recompute_granularity="selective"), "sbh(10 + 24/t)", sbh * (10 + 24 / t)),
            (dict(recompute_granularity="selective", sequence_parallel=True), "34sbh/t", 34 * sbh / t),
            (dict(tp=1), "sbh(34 + 5as/h)", sbh * (34 + Fraction(5 * a * s, h))),
            (dict(tp=1, recompute_granularity="selective"), "34sbh", 34 * sbh)]
    for change, text, expected in rows:
        setting = _setting(**change)
        layer = activation_formula(setting).layers[0]
        assert layer.paper_text == text == paper_row(setting)
        assert layer.paper_bytes == expected
    full = _setting(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    assert activation_formula(full).layers[0].paper_bytes == 2 * sbh
    pa = dataclasses.replace(full, distribute_saved_activations=True)
    assert activation_formula(pa).layers[0].paper_bytes == 2 * sbh // t


def test_selective_saves_70_percent_at_gpt3_and_65_at_mt_nlg():
    """Korthikanti section 5: 5as/h = 80 (GPT-3) and 64 (MT-NLG); selective keeps 34 of 34 + 5as/h."""
    for (s, h, a), saved in (((2048, 12288, 96), 0.70), ((2048, 20480, 128), 0.65)):
        setting = _setting(seq_length=s, hidden_size=h, num_attention_heads=a, tp=1)
        stored = layer_formula(setting, "stored").paper_bytes
        selective = layer_formula(setting, "selective").paper_bytes
        assert round(1 - selective / stored, 2) == saved


def test_flash_attention_is_modeled_except_the_cpus_dropout_fallback():
    """SDPA keeps an fp32 logsumexp in place of the [s, s] items (its output is the projection's input); on the CPU, attention dropout
    sends it to the math fallback, which the formula does not model unless selective recomputation drops it."""
    flash = _setting(flash_attention=True, tp=1)
    layer = layer_formula(flash, "stored")
    s, b, a = 2048, 1, 64
    assert layer.paper_bytes == layer_formula(flash, "selective").paper_bytes  # no [s, s] item
    assert [t.bytes for t in layer.terms if t.name == "flash attention logsumexp fp32"] == [4 * a * s * b]
    assert modeled(flash) is None
    cpu = dataclasses.replace(flash, mask_bytes=None)
    assert "math fallback" in modeled(cpu)
    assert modeled(dataclasses.replace(cpu, recompute_granularity="selective")) is None
    assert modeled(dataclasses.replace(cpu, attention_dropout=False)) is None


def test_rng_state_size_is_torchs():
    assert torch.get_rng_state().numel() == CPU_RNG_STATE_BYTES


LINE = re.compile(r"layers (\S+) \((\w[\w ]*)\) ([\d,/]+) B counted, formula ([\d,]+) B")


def _activation_lines(stdout):
    return [line for line in stdout.splitlines() if line.startswith("activation memory rank")]


def test_training_prints_one_line_per_rank_with_the_formula():
    argv = TINY + ["--tensor-model-parallel-size", "2", "--train-iters", "2", "--bf16", "--hidden-dropout", "0.1",
                   "--attention-dropout", "0.1", "--recompute-activations", "--sequence-parallel"]
    stdout = run_ranks(2, main_capturing_stdout, argv)[0][1]
    lines = _activation_lines(stdout)
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        assert line.startswith(f"activation memory rank {rank} | selective recomputation, sequence parallel, TP 2")
        assert "34sbh/t" in line and "RNG states 2x5056" in line and "LayerNorm mean+rstd fp32 16sb/t" in line
        assert line.count("ratio 1.0000") == 2  # the layers and the micro-batch
        (_, kind, counted, formula), = LINE.findall(line)
        assert kind == "selective" and counted == formula


def _per_layer_bytes(argv):
    stdout = main_capturing_stdout(argv)[1]
    return [LINE.findall(line) for line in _activation_lines(stdout)]


def test_recompute_activations_is_selective_not_whole_layers():
    """The flag's old meaning (whole-layer recomputation, keeping only each layer's input) is gone: it keeps what
    --recompute-granularity selective keeps, every tensor but the core attention's."""
    argv = TINY + ["--train-iters", "1", "--eval-iters", "0"]
    flag = run_ranks(1, _per_layer_bytes, argv + ["--recompute-activations"])[0]
    selective = run_ranks(1, _per_layer_bytes, argv + ["--recompute-granularity", "selective"])[0]
    full = run_ranks(1, _per_layer_bytes, argv + ["--recompute-granularity", "full"])[0]
    assert flag == selective
    (_, kind, counted, formula), = flag[0]
    assert kind == "selective" and counted == formula
    (_, full_kind, full_counted, _), = full[0]
    assert full_kind == "checkpoint"
    sbh = 2 * 16 * 32  # b s h of TINY, fp32
    assert int(full_counted.replace(",", "")) == 4 * sbh + 2 * CPU_RNG_STATE_BYTES
    assert int(counted.replace(",", "")) > 8 * 4 * sbh  # QKV, GELU and fc2 inputs alone are 12 sbh of 4 bytes


BAD = [(["--sequence-parallel"], 1, "--sequence-parallel needs --tensor-model-parallel-size > 1"),
       (["--sequence-parallel", "--seq-length", "15", "--tensor-model-parallel-size", "2"], 2,
        "--sequence-parallel: --seq-length 15 is not divisible by --tensor-model-parallel-size 2"),
       (["--distribute-saved-activations", "--recompute-granularity", "full"], 1,
        "--distribute-saved-activations needs --tensor-model-parallel-size > 1"),
       (["--distribute-saved-activations", "--recompute-activations", "--tensor-model-parallel-size", "2"], 2,
        "--distribute-saved-activations needs --recompute-granularity full"),
       (["--distribute-saved-activations", "--recompute-granularity", "full", "--sequence-parallel",
         "--tensor-model-parallel-size", "2"], 2, "cannot be combined with --sequence-parallel"),
       (["--recompute-activations", "--recompute-method", "block"], 1,
        "--recompute-method block needs --recompute-granularity full"),
       (["--recompute-granularity", "selective", "--recompute-num-layers", "1"], 1,
        "--recompute-num-layers 1 needs --recompute-granularity full"),
       (["--recompute-activations", "--recompute-granularity", "full"], 1, "keep one of them"),
       (["--recompute-granularity", "full", "--recompute-num-layers", "3"], 1,
        "--recompute-num-layers 3 is out of range: it must be between 1 and --num-layers 2"),
       (["--recompute-granularity", "full", "--recompute-num-layers", "0"], 1,
        "--recompute-num-layers 0 is out of range")]


@pytest.mark.parametrize("flags,world,message", BAD)
def test_flags_that_cannot_apply_are_one_line_errors(flags, world, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        run_config(parse_args(TINY + flags), world)
    assert "\n" not in str(error.value)


def test_a_bad_combination_exits_2_before_training():
    code, stderr = exit_code_and_stderr(TINY + ["--sequence-parallel"])
    assert code == 2 and stderr.count("\n") == 1 and "--sequence-parallel" in stderr


def test_help_says_what_the_flags_mean(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping inside hyphenated flag names
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "selective recomputation, the same as --recompute-granularity selective" in text
    assert "Whole-layer recomputation is --recompute-granularity full" in text


class _Scalars:
    def __init__(self):
        self.values = {}

    def scalars(self, values, iteration):
        self.values.update({(tag, iteration): value for tag, value in values.items()})


def _report_to_tensorboard():
    from mpzero.activations.report import report_activation_memory
    groups = init_parallel(2)
    model = GPTModel(dataclasses.replace(BASE, **MODES["sp full"]), groups.tp,
                     seed_everything(3, groups.tp_rank, groups.device))
    tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    counter, board = SavedBytesCounter(model), _Scalars()
    with counter.counting():  # the forward only: the replay in backward saves what it frees again
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
    loss.backward()
    report_activation_memory(counter, model, groups, 2, 16, torch.float32, board, iteration=1)
    return board.values


def test_tensorboard_gets_every_ranks_counted_and_formula_bytes():
    values = run_ranks(2, _report_to_tensorboard)[0]
    for rank in (0, 1):
        for what in ("layers", "micro-batch"):
            counted = values[f"activations/rank-{rank}-{what}-bytes", 1]
            assert counted > 0 and counted == values[f"activations/rank-{rank}-{what}-formula-bytes", 1]
