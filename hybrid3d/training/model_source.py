"""Where the model comes from: a local HF folder of a supported family or a named preset, plus its tokenizer."""

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hybrid3d.config.sections import DataSection, ModelSection
from hybrid3d.data.pipeline import TokenizerSource
from hybrid3d.errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@dataclass
class ModelSource:
    hf_config: object  # the family's transformers config (LlamaConfig, Qwen2Config, ...), vocab_size settled
    tokenizer_dir: Optional[str]  # None: the model folder has none and the built-in one does not fit it
    chat_template: Optional[str]  # hybrid3d.data.chat_template: a Jinja file for the tokenizer
    hf_dir: Optional[str]
    _tokenizer: object = field(default=None, repr=False)

    def tokenizer(self):
        """The tokenizer, loaded on first use (pre-tokenized data never loads one); a ConfigError if there is none."""
        if self._tokenizer is None:
            if self.tokenizer_dir is None:
                raise ConfigError(f"hybrid3d.data.tokenizer: {self.hf_dir} has no tokenizer files and the built-in "
                                  f"tokenizer does not fit its vocab_size {self.hf_config.vocab_size}: set "
                                  "hybrid3d.data.tokenizer, or give pre-tokenized `input_ids`")
            self._tokenizer = _load_tokenizer(self.tokenizer_dir, self.chat_template, self.hf_config.vocab_size,
                                              fits_vocab=self.hf_dir is not None)
        return self._tokenizer

    def tokenizers(self) -> TokenizerSource:
        """What the data path needs to tokenize, if it must, and the config's EOS for pre-tokenized data."""
        eos = getattr(self.hf_config, "eos_token_id", None)
        eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
        template = Path(self.chat_template).read_text(encoding="utf-8") if self.chat_template else None
        identity = f"{self.tokenizer_dir}|{hashlib.sha256((template or '').encode()).hexdigest()[:12]}"
        return TokenizerSource(load=self.tokenizer, identity=identity, config_eos_id=eos)

    def tokenizer_if_any(self):
        """The tokenizer to save next to checkpoints, or None when there is none."""
        try:
            return self.tokenizer()
        except ConfigError:
            return None


def _read_tokenizer(directory: str, key: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception as e:  # transformers raises OSError/ValueError/... for unreadable folders
        raise ConfigError(f"{key}: cannot load a tokenizer from {directory}: "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _load_tokenizer(directory: str, chat_template: Optional[str], vocab_size: int, fits_vocab: bool):
    key = "hybrid3d.data.tokenizer"
    tokenizer = _read_tokenizer(directory, key)
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"{key}: the tokenizer in {directory} has no EOS token")
    if fits_vocab and len(tokenizer) > vocab_size:
        raise ConfigError(f"{key}: {len(tokenizer)} tokens do not fit the model's vocab_size {vocab_size}")
    if chat_template:
        tokenizer.chat_template = Path(chat_template).read_text(encoding="utf-8")
    return tokenizer


def resolve_model(model: ModelSection, data: DataSection) -> ModelSource:
    """The HF config (vocabulary sized to the tokenizer for presets) and the tokenizer to use."""
    from hybrid3d.data.builtin import BUILTIN_VOCAB_SIZE, builtin_tokenizer_path
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

    if data.chat_template and not os.path.isfile(data.chat_template):
        raise ConfigError(f"hybrid3d.data.chat_template: {data.chat_template} is not a file")
    if data.tokenizer:
        if not os.path.isdir(data.tokenizer):
            raise ConfigError(f"hybrid3d.data.tokenizer: {data.tokenizer} is not a folder")
        tokenizer_dir = data.tokenizer
    elif model.hf_model and any(Path(model.hf_model, f).exists() for f in TOKENIZER_FILES):
        tokenizer_dir = model.hf_model
    elif model.hf_model:  # the built-in tokenizer, only if the model's vocabulary holds it
        tokenizer_dir = str(builtin_tokenizer_path()) if BUILTIN_VOCAB_SIZE <= config.vocab_size else None
    else:
        tokenizer_dir = str(builtin_tokenizer_path())
    source = ModelSource(hf_config=config, tokenizer_dir=tokenizer_dir, chat_template=data.chat_template,
                         hf_dir=model.hf_model)
    if not model.hf_model:  # a preset takes the tokenizer's vocabulary
        tokenizer = source.tokenizer()
        config.vocab_size = len(tokenizer)
        config.eos_token_id = tokenizer.eos_token_id
        config.bos_token_id = tokenizer.bos_token_id
    return source
