"""Where the model comes from: a local HF folder of a supported family or a named preset, plus its tokenizer."""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hybrid3d.config.sections import DataSection, ModelSection
from hybrid3d.errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@dataclass
class ModelSource:
    hf_config: object  # the family's transformers config (LlamaConfig, Qwen2Config, ...), vocab_size settled
    tokenizer: object  # a transformers tokenizer
    tokenizer_dir: str
    hf_dir: Optional[str]


def _load_tokenizer(directory: str, key: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception as e:  # transformers raises OSError/ValueError/... for unreadable folders
        raise ConfigError(f"{key}: cannot load a tokenizer from {directory}: "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def resolve_model(model: ModelSection, data: DataSection) -> ModelSource:
    """The HF config (vocabulary sized to the tokenizer for presets) and the tokenizer to use."""
    from hybrid3d.data.builtin import builtin_tokenizer_path
    from hybrid3d.errors import ConversionError
    from hybrid3d.model.hf_source import read_hf_config
    from hybrid3d.model.presets import preset_config

    if model.hf_model:
        if not os.path.isdir(model.hf_model):
            raise ConfigError(f"hybrid3d.model.hf_model: {model.hf_model} is not a folder")
        try:
            config = read_hf_config(Path(model.hf_model))
        except ConversionError as e:
            raise ConfigError(f"hybrid3d.model.hf_model: {e}") from None
    elif model.preset:
        try:
            config = preset_config(model.preset)
        except KeyError as e:
            raise ConfigError(f"hybrid3d.model.preset: {e.args[0]}") from None
    else:
        raise ConfigError("hybrid3d.model: set preset (e.g. \"tiny\") or hf_model (a local Hugging Face model folder)")
    for key, value in model.config_overrides.items():
        if not hasattr(config, key):
            raise ConfigError(f"hybrid3d.model.config_overrides.{key} is not a field of the model's HF config")
        setattr(config, key, value)

    if data.tokenizer:
        if not os.path.isdir(data.tokenizer):
            raise ConfigError(f"hybrid3d.data.tokenizer: {data.tokenizer} is not a folder")
        tokenizer_dir = data.tokenizer
    elif model.hf_model and any(Path(model.hf_model, f).exists() for f in TOKENIZER_FILES):
        tokenizer_dir = model.hf_model
    else:
        tokenizer_dir = str(builtin_tokenizer_path())
    tokenizer = _load_tokenizer(tokenizer_dir, "hybrid3d.data.tokenizer")
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"hybrid3d.data.tokenizer: the tokenizer in {tokenizer_dir} has no EOS token")

    if model.hf_model:
        if len(tokenizer) > config.vocab_size:
            raise ConfigError(f"hybrid3d.data.tokenizer: {len(tokenizer)} tokens do not fit the model's "
                              f"vocab_size {config.vocab_size}")
    else:  # a preset takes the tokenizer's vocabulary
        config.vocab_size = len(tokenizer)
        config.eos_token_id = tokenizer.eos_token_id
        config.bos_token_id = tokenizer.bos_token_id
    return ModelSource(hf_config=config, tokenizer=tokenizer, tokenizer_dir=tokenizer_dir,
                       hf_dir=model.hf_model)
