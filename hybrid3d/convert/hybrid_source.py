"""A hybrid3d DeepSpeed checkpoint (converted, or written by training), read one layer at a time.

Only module weights are read: the `layer_XX-model_YY` files with a pipeline, the `module` of
the `mp_rank_XX` files without one, with an expert-parallel run's `experts_ep_rank_*` files merged
in (checkpoint/experts.py); optimizer files are ignored, except in a ZeRO-3 checkpoint, whose weights only they
hold (convert/zero3_source.py). Files are memory-mapped and
reopened per layer, so the pages of finished layers are released.
"""

import pickle
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from deepspeed.checkpoint import constants as ds

from hybrid3d.checkpoint.experts import expert_files
from hybrid3d.convert import ds_files
from hybrid3d.convert.zero3_source import consolidated_tp_rank
from hybrid3d.checkpoint.schema import CLIENT_SECTION, client_section
from hybrid3d.errors import ConversionError

# Training checkpoints store numpy's RNG state (an ndarray) in their client state. Rebuilding an
# array of plain numbers runs no code, so it is allowed without --allow-pickle.
_NUMPY_GLOBALS = [np.ndarray, np.dtype, type(np.dtype(np.uint32)),
                  getattr(np, "_core", getattr(np, "core", None)).multiarray._reconstruct]


def load_torch_file(path: Path, allow_pickle: bool = False):
    """`torch.load` memory-mapped and, unless allowed otherwise, restricted to tensors, plain data
    and numpy arrays."""
    try:
        with torch.serialization.safe_globals(_NUMPY_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=not allow_pickle, mmap=True)
    except pickle.UnpicklingError:
        raise ConversionError(f"{path}: holds objects other than tensors and plain data; pass --allow-pickle "
                              "to load it anyway (only for checkpoints you trust)") from None
    except (RuntimeError, OSError, EOFError) as e:
        raise ConversionError(f"{path}: not a readable checkpoint file ({str(e).splitlines()[0]})") from None


class HybridCheckpoint:
    def __init__(self, root: Path, tag_dir: Path, tp: int, pp: int, record: dict, allow_pickle: bool,
                 zero3_dtype: Optional[torch.dtype] = None):
        self.root = root  # the folder holding `latest` (and `hf/` when converted)
        self.tag_dir, self.tp, self.pp = tag_dir, tp, pp
        self.record = record  # mp_rank_00's record without its module
        self.allow_pickle = allow_pickle
        self.zero3_dtype = zero3_dtype  # a ZeRO-3 checkpoint's compute dtype; None for any other
        self._consolidated = {}  # ZeRO-3: TP rank -> its weights (zero3_source), read on first use

    @classmethod
    def open(cls, checkpoint_dir, tag: Optional[str] = None, allow_pickle: bool = False) -> "HybridCheckpoint":
        tag_dir, _ = ds_files.resolve_tag_dir(Path(checkpoint_dir), tag)
        zero3 = (not ds_files.model_states_file(tag_dir, 0, 0, 1).is_file()
                 and ds_files.zero3_model_states_file(tag_dir, 0, 0, 0, 1).is_file())
        first = _rank_file(tag_dir, 0, 0, 1, zero3)
        if not first.is_file():
            raise ConversionError(f"{first}: not found")
        record = load_torch_file(first, allow_pickle)
        module = record.pop("module", None) or {}
        tp, pp = _layout(record, first)
        dtype = None
        if zero3:  # the (empty) partitioned module tensors keep the compute dtype
            dtype = next(iter(module.values())).dtype if module else torch.float32
        checkpoint = cls(tag_dir.parent, tag_dir, tp, pp, record, allow_pickle, zero3_dtype=dtype)
        for stage in range(pp):
            for rank in range(tp):
                path = _rank_file(tag_dir, stage, rank, tp, zero3)
                if not path.is_file():
                    raise ConversionError(f"{path}: not found (a tp={tp} pp={pp} checkpoint has "
                                          f"{tp * pp} mp_rank files)")
        return checkpoint

    def _zero3_module(self, rank: int) -> tuple[Path, dict]:
        """A ZeRO-3 checkpoint's weights of TP rank `rank`, consolidated once."""
        if rank not in self._consolidated:
            frozen_excluded = bool(self.record.get("frozen_param_shapes"))  # LoRA: the optimizer holds adapters only
            self._consolidated[rank] = consolidated_tp_rank(self.tag_dir, rank, frozen_excluded)
        return _rank_file(self.tag_dir, 0, rank, self.tp, zero3=True), self._consolidated[rank]

    @property
    def section(self) -> dict:
        """The `hybrid3d` client state (HF config, layout), empty when training stored none."""
        return client_section(self.record)

    def check_layer_files(self, num_layers: int) -> None:
        """Every `layer_XX-model_YY` file a pipeline checkpoint of `num_layers` global layers needs."""
        if self.pp == 1:
            return
        for index in range(num_layers):
            for rank in range(self.tp):
                path = ds_files.layer_file(self.tag_dir, index, rank, self.tp)
                if not path.is_file():
                    raise ConversionError(f"{path}: not found")

    def layer_tensors(self, index: int) -> list[tuple[Path, dict]]:
        """Global layer `index` on each TP rank: (file, {key relative to the layer: tensor})."""
        out = []
        for rank in range(self.tp):
            if self.pp > 1:
                path = ds_files.layer_file(self.tag_dir, index, rank, self.tp)
                out.append((path, load_torch_file(path, self.allow_pickle)))
                continue
            if self.zero3_dtype is not None:
                path, module = self._zero3_module(rank)
            else:
                path = ds_files.model_states_file(self.tag_dir, 0, rank, self.tp)
                module = load_torch_file(path, self.allow_pickle).get("module")
            if not isinstance(module, dict):
                raise ConversionError(f"{path}: has no module weights (a pp=1 checkpoint keeps them there)")
            for expert_path in expert_files(self.tag_dir, rank):  # with EP the module holds EP rank 0's experts only
                module = {**module, **load_torch_file(expert_path, self.allow_pickle)}
            layer = {}
            for name, tensor in module.items():
                layer_index, key = ds_files.split_local_name(name)
                if layer_index == index:
                    layer[key] = tensor
            out.append((path, layer))
        return out

    @property
    def expert_parallel_size(self) -> int:
        """e of an expert-parallel checkpoint (one expert file per EP rank and TP rank), 1 otherwise."""
        return max(1, len(expert_files(self.tag_dir, 0)))

    def stored_dtype(self) -> torch.dtype:
        """The dtype of the embedding as stored (training writes bf16 or fp32 weights); ZeRO-3's compute dtype, which
        its (empty) module tensors record."""
        if self.zero3_dtype is not None:
            return self.zero3_dtype
        path, tensors = self.layer_tensors(0)[0]
        if not tensors:
            raise ConversionError(f"{path}: holds no weights of layer 0 (the embedding)")
        return next(iter(tensors.values())).dtype


def _rank_file(tag_dir: Path, stage: int, tp_rank: int, tp: int, zero3: bool) -> Path:
    """The engine's record of (stage, TP rank): data-parallel rank 0's with ZeRO-3, else the mp_rank file."""
    if zero3:
        return ds_files.zero3_model_states_file(tag_dir, 0, stage, tp_rank, tp)
    return ds_files.model_states_file(tag_dir, stage, tp_rank, tp)


def _layout(record: dict, path: Path) -> tuple[int, int]:
    dims = record.get(ds.CHECKPOINT_PARALLEL_DIMS)
    if dims:
        return int(dims[ds.CHECKPOINT_TP_DEGREE]), int(dims[ds.CHECKPOINT_PP_DEGREE])
    layout = client_section(record).get("layout")
    if layout:
        return int(layout["tp"]), int(layout["pp"])
    raise ConversionError(f"{path}: no {ds.CHECKPOINT_PARALLEL_DIMS} or {CLIENT_SECTION}.layout to tell its TP/PP "
                          "layout")
