"""hybrid3d.lora refused in one line naming the key or file (validate_run, no process group), and the adapter split
rule of the TP plan against hand-computed shapes."""

import json

import pytest
from transformers import LlamaConfig, MixtralConfig

from hybrid3d.errors import ConfigError
from hybrid3d.model import LlamaShape
from hybrid3d.model.tp_plan import LORA_TARGETS, lora_factor_shapes
from hybrid3d.config.validation import validate_run
from tests.distributed.engine_runs import ds_config

LLAMA = dict(vocab_size=203, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def lora_config(lora: dict, **hybrid) -> dict:
    config = ds_config(1, 1, 1)
    config["hybrid3d"].update(lora=lora, model={"hf_model": "/models/base", "init_from_hf": True}, **hybrid)
    return config


def adapter_folder(path, **fields) -> str:
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8.0,
                                                          "target_modules": ["q_proj", "v_proj"], **fields}))
    return str(path)


def test_refusals_name_the_key_or_file(tmp_path):
    shape = LlamaShape.from_hf(LlamaConfig(**LLAMA))
    cases = [
        (lora_config({"rank": 4, "target_modules": ["qkv"]}), "hybrid3d.lora.target_modules must be"),
        (lora_config({"rank": 4, "dropout": 1.0}), "hybrid3d.lora.dropout must be below 1"),
        (lora_config({"rank": 0}), "hybrid3d.lora.rank must be >= 1"),
        (lora_config({"adapter": "x"}), "hybrid3d.lora.adapter needs hybrid3d.lora.rank"),
        (lora_config({"rank": 4, "adapter": str(tmp_path / "none")}), "adapter_config.json: not found"),
        (lora_config({"rank": 8, "target_modules": ["q_proj", "v_proj"], "adapter": adapter_folder(tmp_path / "a")}),
         "adapter_config.json has r = 4, hybrid3d.lora asks for 8"),
        (lora_config({"rank": 4, "target_modules": ["q_proj", "v_proj"],
                      "adapter": adapter_folder(tmp_path / "b", use_dora=True)}), "use_dora = True is not supported"),
    ]
    zero2 = lora_config({"rank": 4}, pipeline_parallel_size=2, pipeline_zero2=True)
    zero2["zero_optimization"]["stage"] = 2
    cases.append((zero2, "not supported with hybrid3d.pipeline_zero2"))
    plain = ds_config(1, 1, 1)
    plain["hybrid3d"]["lora"] = {"rank": 4}
    cases.append((plain, "hybrid3d.lora trains adapters on a pretrained base"))
    for config, needle in cases:
        world = config["hybrid3d"].get("pipeline_parallel_size", 1)
        with pytest.raises(ConfigError) as caught:
            validate_run(config, world, shape)
        assert needle in str(caught.value) and "\n" not in str(caught.value), (needle, str(caught.value))
    moe = LlamaShape.from_hf(MixtralConfig(**LLAMA, num_local_experts=4))
    with pytest.raises(ConfigError, match="LoRA on a mixture-of-experts model"):
        validate_run(lora_config({"rank": 4}), 1, moe)
    accepted = validate_run(lora_config({"rank": 4, "alpha": 16, "target_modules": ["v_proj", "q_proj"]}), 1, shape)
    assert (accepted.shape.lora_rank, accepted.shape.lora_scale, accepted.shape.lora_targets) == (4, 4.0,
                                                                                                   ("q_proj", "v_proj"))


def test_adapter_shapes_follow_the_base_split():
    """A (r x in), B (out x r): beside a column base B splits by output rows; beside a row base A splits by input
    columns; beside kv heads replicated over TP (t > kv) both are whole. Llama-3-8B's sizes, written out."""
    shape = LlamaShape.from_hf(LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                           num_key_value_heads=8, num_hidden_layers=1, vocab_size=128))
    r = 16
    expected_tp2 = {"q_proj": ((r, 4096), (2048, r)), "k_proj": ((r, 4096), (512, r)), "v_proj": ((r, 4096), (512, r)),
                    "o_proj": ((r, 2048), (4096, r)), "gate_proj": ((r, 4096), (7168, r)),
                    "up_proj": ((r, 4096), (7168, r)), "down_proj": ((r, 7168), (4096, r))}
    for module, base in LORA_TARGETS.items():
        assert lora_factor_shapes(base, shape, 2, r) == expected_tp2[module], module
    # TP16 > 8 kv heads: k/v weights replicated, so are their adapters
    assert lora_factor_shapes(LORA_TARGETS["k_proj"], shape, 16, r) == ((r, 4096), (1024, r))


def test_a_saved_shape_read_back_from_json_has_the_same_structure():
    """hybrid3d.json holds the shape as JSON (tuples become lists): a resume must still see the same model (every
    resume was refused as "another model" when lora_targets came back as a list)."""
    import dataclasses

    from hybrid3d.checkpoint.schema import structure

    shape = dataclasses.replace(LlamaShape.from_hf(LlamaConfig(**LLAMA)), lora_rank=4, lora_targets=("q_proj",))
    saved = json.loads(json.dumps(dataclasses.asdict(shape)))
    assert structure(saved) == structure(dataclasses.asdict(shape))
    assert structure(saved) != structure(dataclasses.asdict(dataclasses.replace(shape, lora_targets=("v_proj",))))
