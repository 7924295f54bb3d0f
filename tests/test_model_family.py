"""The model-family records (`mpzero.models.family`): GPT-2 and LLaMA configs find their records, each record
builds, counts and describes exactly what the transformer itself does, the HF export goes through the family's
adapter, and the planner takes a family it has never heard of through the record alone."""

import dataclasses

import pytest
import torch
from torch import nn

from mpzero.cli.arguments import gpt_config, parse_args
from mpzero.errors import ConfigError
from mpzero.inference.hf import adapter_for_config
from mpzero.models import FAMILIES, GPT2, LLAMA, GPTModel, ModelFamily, family, family_of
from mpzero.parallel import init_parallel
from mpzero.planner.activations import activation_setting
from mpzero.planner.shapes import model_shapes
from mpzero.planner.states import tp_comm_bytes
from tests.cli import TINY
from tests.distributed import run_ranks
from tests.test_llama import LLAMA_FLAGS


def test_family_of_names_the_gpt2_and_llama_configs_and_their_hf_adapters():
    gpt2, llama = gpt_config(parse_args(TINY), 300), gpt_config(parse_args(TINY + LLAMA_FLAGS), 300)
    assert (family_of(gpt2), family_of(llama)) == (GPT2, LLAMA)
    assert set(FAMILIES) == {"gpt2", "llama"}
    assert adapter_for_config(gpt2).model_type == "gpt2" == GPT2.hf_model_type
    assert adapter_for_config(llama).model_type == "llama" == LLAMA.hf_model_type
    for argv, config in ((TINY, gpt2), (TINY + LLAMA_FLAGS, llama)):  # the CLI's translation is the record's
        assert family_of(config).config_from_args(parse_args(argv), 300) == config


def test_a_config_no_family_takes_is_one_line():
    with pytest.raises(ConfigError, match="no model family takes a dict: known families are gpt2, llama"):
        family_of({"num_layers": 2})


def _both_builds(config):
    tp = init_parallel(1).tp
    return family_of(config).build(config, tp).state_dict(), GPTModel(config, tp).state_dict()


@pytest.mark.parametrize("flags", [[], LLAMA_FLAGS], ids=["gpt2", "llama"])
def test_the_record_matches_the_transformers_own_figures(flags):
    config = dataclasses.replace(gpt_config(parse_args(TINY + flags), 300), hidden_dropout=0.0, attention_dropout=0.0)
    record = family_of(config)
    built, direct = run_ranks(1, _both_builds, config)[0]
    assert built.keys() == direct.keys() and all(torch.equal(built[name], direct[name]) for name in built)
    config = dataclasses.replace(config, recompute_granularity="full")
    assert record.flops_per_token(config, 2) == config.flops_per_token(2)
    assert record.architecture(config) == config.architecture()
    assert record.activation_setting(config, 2, 4, 32, torch.float32) == config.activation_setting(2, 4, 32,
                                                                                                   torch.float32)
    sp = dataclasses.replace(config, sequence_parallel=True, recompute_granularity=None)
    assert tp_comm_bytes(sp, 2, 4, 32, 4, 3) == family.transformer_tp_comm_bytes(sp, 2, 4, 32, 4, 3) > 0


@dataclasses.dataclass(frozen=True)
class _ToyConfig:
    width: int


class _Toy(nn.Module):
    def __init__(self, config: _ToyConfig, tp, rng=None, device=None):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(config.width, config.width, device=device) for _ in range(2))


def test_the_planner_takes_a_third_family_through_its_record_alone(monkeypatch):
    toy = ModelFamily("toy", _ToyConfig, lambda args, vocab: _ToyConfig(8), _Toy, lambda config, tp: 0.0, None,
                      None, None, lambda config: {"width": config.width},
                      lambda config: isinstance(config, _ToyConfig))
    monkeypatch.setitem(FAMILIES, "toy", toy)
    config = _ToyConfig(8)
    assert family_of(config) is toy
    assert model_shapes(config, 1).numel == 2 * (8 * 8 + 8)
    assert tp_comm_bytes(config, 2, 4, 32, 4, 1) == 0.0  # a family that states no TP traffic
    assert activation_setting(config, 2, 0, 4, 32, torch.float32, cuda=False) is None
