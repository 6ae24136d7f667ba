"""Lazy, tensor-by-tensor access to a Hugging Face model folder's weights.

safetensors (single file or sharded with `model.safetensors.index.json`) is read through
`safe_open`, so only the tensors a rank asks for are materialised. Pickled `pytorch_model.bin`
files can execute code when loaded; they are read only when the caller allows it explicitly.
"""

import json
from collections.abc import Mapping
from pathlib import Path

import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
PICKLE_INDEX = "pytorch_model.bin.index.json"
PICKLE_SINGLE = "pytorch_model.bin"


class HFWeightsError(ValueError):
    """The folder has no readable weights; the message names the folder or file."""


class HFWeights(Mapping):
    """name -> tensor over the weight files of an HF folder, opened on demand."""

    def __init__(self, directory, allow_pickle: bool = False):
        self.directory = Path(directory)
        index, single = self.directory / SAFETENSORS_INDEX, self.directory / SAFETENSORS_SINGLE
        self.pickled = False
        if index.is_file():
            self.file_of = {k: self.directory / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        elif single.is_file():
            self.file_of = {k: single for k in self._safetensors_keys(single)}
        elif (self.directory / PICKLE_INDEX).is_file() or (self.directory / PICKLE_SINGLE).is_file():
            if not allow_pickle:
                raise HFWeightsError(f"{self.directory} has only pickled weights (pytorch_model.bin); "
                                     "convert them to safetensors or allow pickle loading explicitly")
            self.pickled = True
            self.file_of = self._pickle_map()
        else:
            raise HFWeightsError(f"{self.directory} has no model weights (model.safetensors or {SAFETENSORS_INDEX})")
        missing = sorted({str(f) for f in self.file_of.values() if not f.is_file()})
        if missing:
            raise HFWeightsError(f"weight file {missing[0]} is missing")
        self._pickle_cache = {}

    @staticmethod
    def _safetensors_keys(path: Path):
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())

    def _pickle_map(self):
        index = self.directory / PICKLE_INDEX
        if index.is_file():
            return {k: self.directory / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        path = self.directory / PICKLE_SINGLE
        return {k: path for k in torch.load(path, map_location="cpu", weights_only=True)}

    def __getitem__(self, name: str) -> torch.Tensor:
        path = self.file_of[name]
        if self.pickled:
            if path not in self._pickle_cache:  # a .bin file can only be read whole
                self._pickle_cache = {path: torch.load(path, map_location="cpu", weights_only=True)}
            return self._pickle_cache[path][name]
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self):
        return iter(self.file_of)

    def __len__(self) -> int:
        return len(self.file_of)
