"""A Hugging Face model folder, read lazily: the config, tensor names and shapes from file headers,
then one tensor at a time.

Each read opens its file anew and returns a memory-mapped tensor: its pages are freed with the
tensor, so a conversion holds only the tensors it is working on, never a whole shard (an open
`safe_open` handle would keep every page it has touched resident).
Pickled `pytorch_model.bin` files can run code when loaded; they are read only when the caller
allows it, and even then with `weights_only=True`.
"""

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig

from hybrid3d.errors import ConfigError, ConversionError
from hybrid3d.model.config import LlamaShape
from hybrid3d.model.hf_weights import is_adapter, param_specs

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE, PICKLE_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"

_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def read_hf_config(directory: Path):
    """`AutoConfig` of an HF folder; a missing or unreadable config.json is a user error."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConversionError(f"{path}: not found")
    try:
        return AutoConfig.from_pretrained(str(directory))
    except (ValueError, KeyError, OSError) as e:
        raise ConversionError(f"{path}: {str(e).splitlines()[0]}") from None


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: torch.Size
    dtype: torch.dtype


class HFSource(Mapping):
    """Tensor names -> (file, shape, dtype) from headers; `read(name)` loads one tensor.

    It is also a read-only mapping name -> tensor, so `load_hf_state_dict` can fill a model (or
    one pipeline stage of it) straight from the files, reading only the tensors it needs."""

    def __init__(self, directory: Path, config, tensors: dict[str, TensorInfo], pickled: bool):
        self.directory = directory
        self.config = config
        self.tensors = tensors
        self.pickled = pickled

    @classmethod
    def open(cls, directory, allow_pickle: bool = False) -> "HFSource":
        directory = Path(directory)
        if not directory.is_dir():
            raise ConversionError(f"{directory}: model folder not found")
        config = read_hf_config(directory)
        files = _weight_files(directory, allow_pickle)
        pickled = files[0].name.endswith(".bin")
        tensors = {}
        for file in files:
            for name, info in (_pickle_headers(file) if pickled else _safetensors_headers(file)).items():
                if name in tensors:
                    raise ConversionError(f"{file}: tensor '{name}' also appears in {tensors[name].file.name}")
                tensors[name] = info
        _check_index(directory, tensors, pickled)
        return cls(directory, config, tensors, pickled)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise KeyError(name)
        return self.read(name)

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def read(self, name: str) -> torch.Tensor:
        """The full tensor, memory-mapped from its file (pages freed with the tensor)."""
        info = self.tensors[name]
        if self.pickled:
            return torch.load(info.file, map_location="cpu", weights_only=True, mmap=True)[name]
        with safe_open(str(info.file), framework="pt") as f:
            return f.get_tensor(name)


def _weight_files(directory: Path, allow_pickle: bool) -> list[Path]:
    for index_name, single_name, pickled in ((SAFETENSORS_INDEX, SAFETENSORS, False), (PICKLE_INDEX, PICKLE, True)):
        index, single = directory / index_name, directory / single_name
        if not (index.is_file() or single.is_file()):
            continue
        if pickled and not allow_pickle:
            found = index if index.is_file() else single
            raise ConversionError(f"{found}: pickle weights are read only with --allow-pickle "
                                  "(loading a pickle can run code; use it only for checkpoints you trust)")
        if not index.is_file():
            return [single]
        files = sorted(set(_read_index(index).values()))
        missing = [name for name in files if not (directory / name).is_file()]
        if missing:
            raise ConversionError(f"{directory / missing[0]}: shard listed in {index.name} not found")
        return [directory / name for name in files]
    raise ConversionError(f"{directory}: no {SAFETENSORS}, {SAFETENSORS_INDEX} or {PICKLE} found")


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ConversionError(f"{index}: not a weight index ({e.__class__.__name__}: {e})") from None
    return weight_map


def _check_index(directory: Path, tensors: dict[str, TensorInfo], pickled: bool) -> None:
    """An index that names a tensor its shard lacks means a damaged or mixed-up download."""
    index = directory / (PICKLE_INDEX if pickled else SAFETENSORS_INDEX)
    if not index.is_file():
        return
    for name, file in _read_index(index).items():
        if name not in tensors or tensors[name].file.name != file:
            raise ConversionError(f"{directory / file}: lacks tensor '{name}' that {index.name} places there")


def _safetensors_headers(file: Path) -> dict[str, TensorInfo]:
    try:
        with safe_open(str(file), framework="pt") as f:
            out = {}
            for name in f.keys():
                piece = f.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype())
                if dtype is None:
                    raise ConversionError(f"{file}: tensor '{name}' has dtype {piece.get_dtype()}, not a float type")
                out[name] = TensorInfo(file, torch.Size(piece.get_shape()), dtype)
            return out
    except SafetensorError as e:
        raise ConversionError(f"{file}: not a readable safetensors file ({e})") from None


def _pickle_headers(file: Path) -> dict[str, TensorInfo]:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises many types for a damaged or non-weights pickle
        raise ConversionError(f"{file}: not a readable weights file ({str(e).splitlines()[0]})") from None
    return {name: TensorInfo(file, t.shape, t.dtype) for name, t in state.items()}


def multi_token_prediction_tensors(source: HFSource) -> list[str]:
    """The tensors of DeepSeek-V3's multi-token-prediction layers in `source` (`model.layers.<i>.` for the
    num_nextn_predict_layers indices from num_hidden_layers on): a second objective the causal LM does not use,
    which transformers skips on load (`DeepseekV3PreTrainedModel._keys_to_ignore_on_load_unexpected`)."""
    config = source.config
    extra = getattr(config, "num_nextn_predict_layers", 0) or 0
    if config.model_type != "deepseek_v3" or not extra:
        return []
    first = config.num_hidden_layers
    prefixes = tuple(f"model.layers.{i}." for i in range(first, first + extra))
    return sorted(name for name in source.tensors if name.startswith(prefixes))


def open_hf_weights(folder: str, shape: LlamaShape, tp_size: int) -> HFSource:
    """The HF folder's weights (`HFSource`), refused unless it holds every base weight `shape` needs."""
    weights = HFSource.open(folder)
    missing = sorted({s.hf_name for s in param_specs(shape, tp_size) if not is_adapter(s)} - set(weights))
    if missing:
        raise ConfigError(f"hybrid3d.model.hf_model: {folder} lacks weight {missing[0]}")
    return weights
