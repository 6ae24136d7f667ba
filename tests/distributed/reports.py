"""Putting the ranks' reports of one run together, and reading what a run wrote."""

from pathlib import Path

import torch
from safetensors.torch import load_file


def merged_weights(reports: list, key: str = "weights") -> dict:
    """{HF name: tensor} over the ranks' `report[key]` (each rank reports the tensors its stage holds, gathered over
    TP); ranks that hold the same tensor (TP and DP replicas, tied copies) must agree bit for bit."""
    out = {}
    for report in reports:
        for name, tensor in report[key].items():
            if name in out:
                assert torch.equal(out[name], tensor), f"{name} differs between ranks holding it"
            out[name] = tensor
    return out


def read_safetensors_folder(directory: Path) -> dict:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors
