"""PEFT's LoRA adapter folder, read and written: `adapter_config.json` and `adapter_model.safetensors`, whose tensors
are named `base_model.model.<HF name>` (`model.layers.<i>.self_attn.q_proj.lora_A.weight`, ...), as
`PeftModel.save_pretrained` writes them and `PeftModel.from_pretrained` loads them onto the HF model."""

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from hybrid3d.errors import ConfigError
from hybrid3d.model.config import LlamaShape
from hybrid3d.model.hf_weights import is_adapter, param_specs
from hybrid3d.model.tp_plan import lora_weights

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# adapter_config.json settings hybrid3d does not implement, with the value that means "off"
_OFF = {"use_rslora": False, "use_dora": False, "modules_to_save": None, "bias": "none", "fan_in_fan_out": False,
        "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}


def read_adapter_config(folder) -> dict:
    """The folder's adapter_config.json, refused in one line (naming the file) unless it is a plain LoRA adapter."""
    path = Path(folder) / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found (hybrid3d.lora.adapter must be a PEFT adapter folder)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{path}: peft_type is {config.get('peft_type')!r}; hybrid3d reads LORA adapters")
    for key, off in _OFF.items():
        if config.get(key, off) not in (off, None, {}, False):
            raise ConfigError(f"{path}: {key} = {config[key]!r} is not supported (only {off!r})")
    return config


def read_adapter_tensors(folder, shape: LlamaShape) -> dict:
    """{HF name: tensor} of the folder's adapter weights; refused in one line when they are not exactly the
    adapters `shape` has (rank, target modules, layers)."""
    path = Path(folder) / WEIGHTS_FILE
    if not path.is_file():
        raise ConfigError(f"{path}: not found")
    tensors = {name.removeprefix(PEFT_PREFIX): t for name, t in load_file(str(path)).items()}
    expected = {spec.hf_name for spec in param_specs(shape, 1) if is_adapter(spec)}
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ConfigError(f"{path}: does not match hybrid3d.lora (rank {shape.lora_rank}, target_modules "
                          f"{list(shape.lora_targets)}): missing {missing[:2]}, unexpected {unexpected[:2]}")
    return tensors


def write_adapter(folder, shape: LlamaShape, tensors: dict, base_model: str | None) -> None:
    """Write `tensors` ({HF name: tensor}: the adapters of param_specs) as a PEFT LoRA adapter folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": shape.lora_rank, "lora_alpha": shape.lora_alpha, "lora_dropout": shape.lora_dropout,
              "target_modules": sorted(shape.lora_targets), "inference_mode": True, "init_lora_weights": True, **_OFF}
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    save_file({PEFT_PREFIX + name: t.detach().contiguous() for name, t in tensors.items()}, str(folder / WEIGHTS_FILE),
              metadata={"format": "pt"})


def adapted_weights(shape: LlamaShape) -> dict:
    """{HF name of an adapted base weight: (its A's HF name, its B's)} over every layer."""
    return {f"model.layers.{i}.{weight}": (f"model.layers.{i}.{a_name}", f"model.layers.{i}.{b_name}")
            for i in range(shape.num_layers) for a_name, b_name, weight in lora_weights(shape, shape.lora_targets)}


def merged_weight(weight, factors, adapters: dict, shape: LlamaShape):
    """A base weight with its adapter merged in, W + (alpha/r) · B A in fp32, cast back to W's dtype; `factors`:
    its (A, B) names in `adapters` (`adapted_weights`), or None for a weight without one (returned as it is)."""
    if factors is None:
        return weight
    a, b = (adapters[name].float() for name in factors)
    return (weight.float() + (b @ a) * shape.lora_scale).to(weight.dtype)

