"""hybrid2hf: a hybrid3d DeepSpeed checkpoint -> an HF folder `from_pretrained` loads (Llama, Mistral, Qwen2,
Qwen3 or Mixtral: config.json names the family's class).

TP shards are merged with `merge_tp_shards` (the inverse of the slicing table; it strips the
vocabulary padding and refuses replicated tensors that differ between TP ranks). Layers are read
one at a time and each merged tensor goes straight into a streamed safetensors shard, so the
process holds one layer's shards and one merged tensor.

The HF config comes from `--hf-config DIR` if given, else from the checkpoint (its `hybrid3d`
client state or the tag's hybrid3d.json), else from the `hf/` folder that conversion and training
keep next to it. Tokenizer and generation config files are copied from that folder (or from DIR).
"""

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from transformers import GenerationConfig

from hybrid3d.checkpoint.files import HF_FILES_DIR, read_meta
from hybrid3d.convert import ds_files
from hybrid3d.convert.hybrid_source import HybridCheckpoint
from hybrid3d.checkpoint.schema import hf_config_from_section, recorded_lora
from hybrid3d.convert.model_layout import hf_parameter_shapes
from hybrid3d.convert.output import copy_metadata_files, staging_dir
from hybrid3d.convert.safetensors_stream import ShardedSafetensorsWriter, parse_size
from hybrid3d.errors import ConversionError
from hybrid3d.config.support import check_experts
from hybrid3d.model.config import HF_CAUSAL_LM_CLASSES, LlamaShape
from hybrid3d.model.hf_source import read_hf_config
from hybrid3d.model.hf_source import HFSource
from hybrid3d.model.hf_weights import is_adapter, merge_tp_shards, param_specs
from hybrid3d.model.peft_adapter import WEIGHTS_FILE, adapted_weights, merged_weight, write_adapter
from hybrid3d.model.layers import layer_classes
from hybrid3d.parallel.layout import ParallelLayout
from hybrid3d.model.tp_plan import check_split, lora_factor_shapes

DEFAULT_MAX_SHARD_SIZE = "5GB"


@dataclass(frozen=True)
class Hybrid2HfResult:
    out_dir: Path
    layout: ParallelLayout
    dtype: torch.dtype
    files: list
    seconds: float


LORA_EXPORTS = ("adapter", "merged")


def hybrid_to_hf(checkpoint_dir, out_dir, dtype: Optional[torch.dtype] = None, tag: Optional[str] = None,
                 hf_config_dir=None, max_shard_size=DEFAULT_MAX_SHARD_SIZE,
                 allow_pickle: bool = False, lora: Optional[str] = None) -> Hybrid2HfResult:
    """Export; `dtype` None keeps the stored dtype. Bad input raises a UserError type before
    anything is written (a damaged tensor found mid-way removes the partial output).
    A LoRA run's checkpoint holds adapters only: `lora` "adapter" writes them as a PEFT adapter folder,
    "merged" the HF model with them merged into the base weights of `hf_config_dir` (the model trained on)."""
    start = time.perf_counter()
    checkpoint = HybridCheckpoint.open(checkpoint_dir, tag, allow_pickle)
    config, side_dir = resolve_hf_config(checkpoint, hf_config_dir)
    adapters = recorded_lora(read_meta(checkpoint.tag_dir))
    if adapters and lora is None:
        raise ConversionError(f"{checkpoint.tag_dir}: a LoRA checkpoint (adapters only): pass --lora adapter or "
                              "--lora merged (with --hf-config, the base model)")
    if lora is not None and not adapters:
        raise ConversionError(f"{checkpoint.tag_dir}: --lora {lora}: the checkpoint holds no LoRA adapters "
                              "(its hybrid3d.json records none)")
    if lora == "merged" and hf_config_dir is None:
        raise ConversionError("--lora merged needs --hf-config: the base model folder the adapters were trained on")
    shape = dataclasses.replace(LlamaShape.from_hf(config), **adapters)
    tp = checkpoint.tp
    check_split(shape, tp, checkpoint.pp)
    check_experts(shape.num_experts, tp, checkpoint.pp, 1, 1)
    if lora is not None:
        return _export_lora(checkpoint, shape, Path(out_dir), lora, dtype, config, side_dir, hf_config_dir,
                            _max_bytes(max_shard_size), start)
    specs = param_specs(shape, tp)
    expected = hf_parameter_shapes(config)
    mapped = {spec.hf_name for spec in specs}
    if set(expected) != mapped:
        raise RuntimeError(f"param_specs and {HF_CAUSAL_LM_CLASSES[shape.model_type]} disagree on "
                           f"{sorted(set(expected) ^ mapped)}")
    num_layers = len(layer_classes(shape))
    checkpoint.check_layer_files(num_layers)
    dtype = dtype or checkpoint.stored_dtype()
    max_bytes = _max_bytes(max_shard_size)

    by_layer = _by_layer(specs)
    with staging_dir(out_dir) as staging:
        writer = ShardedSafetensorsWriter(staging, [(s.hf_name, dtype, expected[s.hf_name]) for s in specs], max_bytes)
        for index in sorted(by_layer):
            shards = checkpoint.layer_tensors(index)
            for spec in by_layer[index]:
                writer.write(spec.hf_name, _merge(spec, shards, shape, expected[spec.hf_name]).to(dtype))
            del shards
        files = writer.close()
        _write_configs(config, dtype, side_dir, staging)
    return Hybrid2HfResult(Path(out_dir), ParallelLayout(tp, checkpoint.pp, 1), dtype, [f.name for f in files],
                           time.perf_counter() - start)


def _max_bytes(max_shard_size) -> int:
    try:
        return parse_size(max_shard_size)
    except ValueError as e:
        raise ConversionError(f"max shard size: {e}") from None


def _by_layer(specs) -> dict:
    """{global layer index: its specs}, the order a layer's shards are read in (one layer in memory at a time)."""
    by_layer = {}
    for spec in specs:
        by_layer.setdefault(ds_files.split_local_name(spec.local_name)[0], []).append(spec)
    return by_layer


def _export_lora(checkpoint: HybridCheckpoint, shape: LlamaShape, out_dir: Path, lora: str, dtype, config,
                 side_dir, base_dir, max_bytes: int, start: float) -> Hybrid2HfResult:
    """The adapters of a LoRA checkpoint, merged over TP (the plan's kinds), as a PEFT adapter folder or merged into
    the base model's weights (streamed one tensor at a time, as the plain export streams one layer)."""
    tensors = {}
    for index, specs in sorted(_by_layer(s for s in param_specs(shape, checkpoint.tp) if is_adapter(s)).items()):
        shards = checkpoint.layer_tensors(index)
        for spec in specs:
            tensors[spec.hf_name] = _merge(spec, shards, shape, _adapter_shape(spec.hf_name, shape))
    dtype = dtype or next(iter(tensors.values())).dtype
    with staging_dir(out_dir) as staging:
        if lora == "adapter":
            write_adapter(staging, shape, {n: t.to(dtype) for n, t in tensors.items()}, str(base_dir) if base_dir else
                          (config.name_or_path or None))
            files = [WEIGHTS_FILE]
        else:
            base, adapted = HFSource.open(str(base_dir)), adapted_weights(shape)
            writer = ShardedSafetensorsWriter(staging, [(n, dtype, info.shape) for n, info in base.tensors.items()],
                                              max_bytes)
            for name in base:
                writer.write(name, merged_weight(base[name], adapted.get(name), tensors, shape).to(dtype))
            files = [f.name for f in writer.close()]
            _write_configs(config, dtype, side_dir, staging)
    return Hybrid2HfResult(out_dir, ParallelLayout(checkpoint.tp, checkpoint.pp, 1), dtype, files,
                           time.perf_counter() - start)


def _adapter_shape(hf_name: str, shape: LlamaShape) -> torch.Size:
    """The full (unsharded) shape of adapter factor `hf_name` (`model.layers.<i>.<proj>.lora_A.weight`, ...)."""
    prefix, _, rest = hf_name.partition(".lora_")
    base = prefix.split(".", 3)[3] + ".weight"  # self_attn.q_proj.weight, ...
    a, b = lora_factor_shapes(base, shape, 1, shape.lora_rank)
    return torch.Size(a if rest.startswith("A") else b)


def resolve_hf_config(checkpoint: HybridCheckpoint, hf_config_dir=None):
    """(HF config, folder to copy tokenizer/generation files from, or None). Sources, first found:
    `hf_config_dir`; the `hybrid3d` client state; the tag's hybrid3d.json; the `hf/` folder."""
    kept = checkpoint.root / HF_FILES_DIR
    kept = kept if kept.is_dir() else None
    if hf_config_dir is not None:
        return read_hf_config(Path(hf_config_dir)), Path(hf_config_dir)
    config = hf_config_from_section(checkpoint.section) or hf_config_from_section(read_meta(checkpoint.tag_dir))
    if config is not None:
        return config, kept
    if kept is not None:
        return read_hf_config(kept), kept
    raise ConversionError(f"{checkpoint.tag_dir}: the checkpoint stores no HF config and {checkpoint.root} has no "
                          f"{HF_FILES_DIR}/ folder; pass --hf-config with the original model folder")


def _merge(spec, shards, shape: LlamaShape, full_shape: torch.Size) -> torch.Tensor:
    layer_index, key = ds_files.split_local_name(spec.local_name)
    pieces = []
    for path, tensors in shards:
        if key not in tensors:
            raise ConversionError(f"{path}: lacks '{key}' of layer {layer_index} ({spec.hf_name})")
        pieces.append(tensors[key])
    try:
        full = merge_tp_shards(spec, pieces, shape)
    except (ValueError, RuntimeError) as e:  # replicated copies differ, or shard shapes do not concatenate
        raise ConversionError(f"{shards[0][0].parent}: {spec.hf_name}: {str(e).splitlines()[0]}") from None
    if full.shape != full_shape:
        raise ConversionError(f"{shards[0][0]}: '{key}' of layer {layer_index} merges to {tuple(full.shape)}, "
                              f"config.json implies {tuple(full_shape)} for {spec.hf_name}")
    return full


def _write_configs(config, dtype: torch.dtype, side_dir: Optional[Path], out: Path) -> None:
    """config.json for the exported dtype; generation config and tokenizer files copied when
    known, else a generation config derived from the model config."""
    config.architectures = [HF_CAUSAL_LM_CLASSES[config.model_type]]
    config.dtype = dtype
    copied = copy_metadata_files(side_dir, out, skip={"config.json"}) if side_dir is not None else []
    config.save_pretrained(out)
    if "generation_config.json" not in copied:
        GenerationConfig.from_model_config(config).save_pretrained(out)
