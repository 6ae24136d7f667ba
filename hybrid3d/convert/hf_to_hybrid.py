"""hf2hybrid: an HF folder (Llama, Mistral, Qwen2, Qwen3, Mixtral) -> a module-only DeepSpeed checkpoint
at a given TP/PP layout.

The output is what `build_trainer(...).save(dir)` writes at that layout, minus optimizer state:
the trainer loads it with `Trainer.load` (module weights, fresh optimizer). Slicing goes through
`param_specs` / `shard_hf_tensor`, the table the model itself loads HF weights with.

Memory: with a pipeline (pp > 1) one global layer is converted at a time, so the process holds
one HF tensor plus that layer's TP shards. Without one (pp == 1) DeepSpeed keeps a TP rank's whole
state dict in one `mp_rank_XX` file; ranks are written one after another, holding 1/tp of the
model plus one HF tensor.
"""

import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from hybrid3d.checkpoint.files import HF_FILES_DIR, write_meta
from hybrid3d.checkpoint.schema import MANIFEST_KEY, at_step, client_state, layout_record, tag_record
from hybrid3d.convert import ds_files
from hybrid3d.convert.model_layout import (
    buffer_names,
    hf_parameter_shapes,
    meta_model,
    pipeline_stages,
    stage_param_shapes,
)
from hybrid3d.convert.output import copy_metadata_files, staging_dir
from hybrid3d.errors import ConversionError
from hybrid3d.config.support import check_experts
from hybrid3d.model.config import LlamaShape
from hybrid3d.model.hf_source import HFSource, multi_token_prediction_tensors
from hybrid3d.model.hf_weights import ParamSpec, param_specs, shard_hf_tensor
from hybrid3d.parallel.layout import ParallelLayout
from hybrid3d.model.tp_plan import check_split

# Extra tensors some HF checkpoints carry that the model recomputes (RoPE's inverse frequencies).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Hf2HybridResult:
    out_dir: Path
    shape: LlamaShape
    layout: ParallelLayout
    files: int
    seconds: float
    skipped: tuple = ()  # the source's tensors left out: DeepSeek-V3's multi-token-prediction layers


def hf_to_hybrid(hf_dir, out_dir, tp: int, pp: int, dtype: Optional[torch.dtype] = None, allow_pickle: bool = False,
                 vocab_pad_multiple: int = 128) -> Hf2HybridResult:
    """Convert; `dtype` None keeps each tensor's stored dtype. Raises a UserError type for bad
    input before anything is written."""
    start = time.perf_counter()
    source = HFSource.open(hf_dir, allow_pickle)
    shape = LlamaShape.from_hf(source.config, vocab_pad_multiple=vocab_pad_multiple)
    layout = ParallelLayout(tp, pp, 1)
    check_split(shape, layout.tp, layout.pp)
    check_experts(shape.num_experts, layout.tp, layout.pp, 1, 1)
    specs = param_specs(shape, tp)
    skipped = tuple(multi_token_prediction_tensors(source))
    check_source_tensors(source, specs, set(skipped))
    models = [meta_model(shape, rank, tp) for rank in range(tp)]
    state = client_state(source.config, shape, tp, pp, converted_from=str(Path(hf_dir).absolute()), module_only=True)

    with staging_dir(out_dir) as staging:
        tag_dir = staging / ds_files.CONVERTED_TAG
        tag_dir.mkdir()
        writer = _Writer(source, specs, shape, models, dtype, tag_dir)
        if pp > 1:
            for index in range(len(models[0].layers)):
                writer.write_layer_files(index)
        stages = pipeline_stages(shape, pp) if pp > 1 else [range(len(models[0].layers))]
        for stage, layers in enumerate(stages):
            for rank, model in enumerate(models):
                module = writer.tp_rank_state_dict(rank) if pp == 1 else None
                record = ds_files.model_states_record(
                    module=module, param_shapes=stage_param_shapes(model, layers), buffer_names=buffer_names(model),
                    tp=tp, pp=pp, client_state=state)
                torch.save(record, ds_files.model_states_file(tag_dir, stage, rank, tp))
                del module, record
        manifest = {path.name: path.stat().st_size for path in sorted(tag_dir.glob("*.pt"))}
        record = at_step(tag_record(layout_record(tp, pp), shape, source.config, module_only=True), 0, 0)
        write_meta(tag_dir, {**record, MANIFEST_KEY: manifest})
        (staging / ds_files.LATEST).write_text(ds_files.CONVERTED_TAG)
        copy_metadata_files(source.directory, staging / HF_FILES_DIR)
        files = len(manifest)
    return Hf2HybridResult(Path(out_dir), shape, layout, files, time.perf_counter() - start, skipped)


def check_source_tensors(source: HFSource, specs: list[ParamSpec], skipped: frozenset = frozenset()) -> None:
    """Every tensor the model needs is there with the shape config.json implies, and nothing else
    is (but the `skipped` ones, said so by the caller): a tensor the table does not map would be silently dropped
    otherwise."""
    expected = hf_parameter_shapes(source.config)
    mapped = {spec.hf_name for spec in specs}
    if set(expected) != mapped:
        raise RuntimeError(f"param_specs and the HF class disagree on {sorted(set(expected) ^ mapped)}")
    for name, full_shape in expected.items():
        info = source.tensors.get(name)
        if info is None:
            raise ConversionError(f"{source.directory}: no tensor '{name}' in the weight files")
        if info.shape != full_shape:
            raise ConversionError(f"{info.file}: tensor '{name}' has shape {tuple(info.shape)}, config.json implies "
                                  f"{tuple(full_shape)}")
    tied_duplicates = {"lm_head.weight"} if source.config.tie_word_embeddings else set()
    for name, info in source.tensors.items():
        if name not in mapped and name not in tied_duplicates | skipped and not name.endswith(IGNORED_SUFFIXES):
            raise ConversionError(f"{info.file}: tensor '{name}' has no place in the model "
                                  f"(model_type {source.config.model_type})")


class _Writer:
    """Reads HF tensors and cuts them into TP shards, keyed and ordered as the model's state dict."""

    def __init__(self, source, specs, shape, models, dtype, tag_dir: Path):
        self.source, self.shape, self.models, self.dtype, self.tag_dir = source, shape, models, dtype, tag_dir
        self.tp = len(models)
        self.specs = {spec.local_name: spec for spec in specs}

    def _shards(self, spec: ParamSpec, ranks) -> list[torch.Tensor]:
        full = self.source.read(spec.hf_name)
        return [self._owned(shard_hf_tensor(spec, full, self.shape, rank, self.tp), full) for rank in ranks]

    def _owned(self, shard: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """A compact tensor of its own: `torch.save` of a view would write the whole underlying
        tensor. A shard that already is one (a padded vocabulary slice) is not copied again."""
        dtype = self.dtype or shard.dtype
        storage = shard.untyped_storage()
        if (storage.data_ptr() != full.untyped_storage().data_ptr() and shard.is_contiguous()
                and storage.nbytes() == shard.nbytes):
            return shard.to(dtype)
        return torch.empty(shard.shape, dtype=dtype).copy_(shard)

    def write_layer_files(self, index: int) -> None:
        """`layer_XX-model_YY` files of global layer `index` for every TP rank."""
        layers = [model.layers[index] for model in self.models]
        prefix = ds_files.TIED_PREFIX if index == 0 and self.shape.tie_word_embeddings else f"{index}."
        states = [OrderedDict() for _ in layers]
        for key in layers[0].state_dict(keep_vars=True):
            for rank, shard in enumerate(self._shards(self.specs[prefix + key], range(self.tp))):
                states[rank][key] = shard
        for rank, (layer, state) in enumerate(zip(layers, states)):
            self._check(layer.state_dict(keep_vars=True), state, prefix)
            torch.save(state, ds_files.layer_file(self.tag_dir, index, rank, self.tp))

    def tp_rank_state_dict(self, rank: int) -> "OrderedDict[str, torch.Tensor]":
        """TP rank `rank`'s whole state dict, in module order (the `module` of a pp == 1 checkpoint)."""
        expected = self.models[rank].state_dict(keep_vars=True)
        state = OrderedDict((name, self._shards(self.specs[name], [rank])[0]) for name in expected)
        self._check(expected, state, "")
        return state

    def _check(self, expected, state, prefix: str) -> None:
        for key, param in expected.items():
            if state[key].shape != param.shape:
                raise RuntimeError(f"'{prefix}{key}': shard {tuple(state[key].shape)}, model {tuple(param.shape)}")
