"""Sharded safetensors written one tensor at a time, in Hugging Face's file and index layout.

`safetensors.torch.save_file` needs every tensor of a shard in memory at once. A safetensors
file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte
offsets) and the raw bytes in header order; when every name, dtype and shape is known up front
the header can be written first and each tensor appended as it is produced, so an export holds
one tensor, not a shard (format: https://github.com/huggingface/safetensors#format).
"""

import json
import re
import struct
from pathlib import Path
from typing import Optional

import torch

SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


def parse_size(size) -> int:
    """'5GB' (decimal, as transformers reads it), '500MiB' or a byte count -> bytes."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(size))
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {size!r} (examples: 5GB, 500MB, 2GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


class ShardedSafetensorsWriter:
    """Writes the tensors of `plan` [(name, dtype, shape)] in that order into shards of at most
    `max_shard_bytes` (a larger tensor gets a shard of its own), then the index if sharded."""

    def __init__(self, directory: Path, plan: list[tuple[str, torch.dtype, torch.Size]], max_shard_bytes: int,
                 metadata: Optional[dict] = None):
        self.directory = Path(directory)
        self.plan = plan
        self.metadata = {"format": "pt", **(metadata or {})}
        self.shards = _assign_shards(plan, max_shard_bytes)
        count = len(self.shards)
        self.filenames = [SINGLE_FILE] if count == 1 else [
            f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        self._next = 0  # index into plan
        self._shard = -1
        self._file = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected_name, dtype, shape = self.plan[self._next]
        if (name, tensor.dtype, tensor.shape) != (expected_name, dtype, shape):
            raise ValueError(f"expected {expected_name} {dtype} {tuple(shape)}, got {name} {tensor.dtype} "
                             f"{tuple(tensor.shape)}")
        if self._file is None:
            self._open_next_shard()
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._file.write(memoryview(data))
        self._next += 1
        if self._next == self.shards[self._shard].stop:
            self._file.close()
            self._file = None

    def close(self) -> list[Path]:
        """Finish: every planned tensor must have been written. Returns the files written."""
        if self._next != len(self.plan):
            raise ValueError(f"{len(self.plan) - self._next} planned tensors were not written "
                             f"(next: {self.plan[self._next][0]})")
        written = [self.directory / f for f in self.filenames]
        if len(self.filenames) > 1:
            weight_map = {name: self.filenames[s] for s, shard in enumerate(self.shards) for name, _, _ in
                          (self.plan[i] for i in shard)}
            index = {"metadata": {"total_size": sum(_nbytes(d, s) for _, d, s in self.plan)},
                     "weight_map": dict(sorted(weight_map.items()))}
            (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            written.append(self.directory / INDEX_FILE)
        return written

    def _open_next_shard(self) -> None:
        self._shard += 1
        header, offset = {}, 0
        for i in self.shards[self._shard]:
            name, dtype, shape = self.plan[i]
            size = _nbytes(dtype, shape)
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
        header["__metadata__"] = self.metadata
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the reference writer aligns the data to 8 bytes
        self._file = open(self.directory / self.filenames[self._shard], "wb")
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)


def _nbytes(dtype: torch.dtype, shape) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def _assign_shards(plan, max_shard_bytes: int) -> list[range]:
    """Greedy in plan order, like `save_pretrained`: start a new shard when the next tensor would
    overflow a non-empty one."""
    shards, start, size = [], 0, 0
    for i, (_, dtype, shape) in enumerate(plan):
        nbytes = _nbytes(dtype, shape)
        if i > start and size + nbytes > max_shard_bytes:
            shards.append(range(start, i))
            start, size = i, 0
        size += nbytes
    shards.append(range(start, len(plan)))
    return shards
