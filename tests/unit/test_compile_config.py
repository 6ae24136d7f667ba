"""`hybrid3d.compile` (training/compile.py): a backend Dynamo knows, refused with experts, and the blocks compiled
in place (names and state dict unchanged). Compiled training against HF: tests/distributed/test_engine.py."""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig

from hybrid3d.config.sections import CompileSection
from hybrid3d.errors import ConfigError
from hybrid3d.model import LlamaShape
from hybrid3d.model.llama import LlamaSequential
from hybrid3d.parallel.rank_groups import TensorParallelGroup
from hybrid3d.training.compile import compile_blocks
from hybrid3d.config.validation import validate_run
from tests.distributed.engine_runs import ds_config

SHAPE = LlamaShape.from_hf(LlamaConfig(vocab_size=203, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2))


def config(**compile_section) -> dict:
    raw = ds_config(1, 1, 1)
    raw["hybrid3d"]["compile"] = compile_section
    return raw


def test_refusals_name_the_key():
    with pytest.raises(ConfigError) as caught:
        validate_run(config(enabled=True, backend="fastest"), 1, SHAPE)
    assert str(caught.value).startswith("hybrid3d.compile.backend must be one of ") and "inductor" in str(caught.value)
    moe = dataclasses.replace(SHAPE, num_experts=4)
    with pytest.raises(ConfigError, match="^hybrid3d.compile.enabled is not supported with a mixture-of-experts"):
        validate_run(config(enabled=True), 1, moe)
    validate_run(config(enabled=False, backend="fastest"), 1, moe)  # off: nothing to check


def test_blocks_compile_in_place():
    model = LlamaSequential(SHAPE, TensorParallelGroup.single())
    names = list(model.state_dict())
    assert compile_blocks(model, CompileSection()) == 0  # off by default
    assert compile_blocks(model, CompileSection(enabled=True, backend="eager")) == 2
    assert list(model.state_dict()) == names
    ids = torch.randint(0, 203, (2, 8))
    assert model(ids).shape == (2, 8, 256)  # V padded to 128·t
