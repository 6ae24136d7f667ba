"""Where DeepSpeed keeps each piece of a checkpoint, and the module-state record it reads back.

A checkpoint folder holds `latest` (the tag) and `<tag>/`:
- `layer_XX-model_YY-model_states.pt` (pp > 1): global layer XX's state dict on TP rank YY, keys
  relative to the layer (`weight`, `self_attn.q_proj.weight`); DeepSpeed's PipelineModule
  writes one per layer and TP rank (`ckpt_layer_path`) and reads them per layer, so these files do
  not depend on how layers are partitioned into stages;
- `mp_rank_XX_model_states.pt`, XX = stage * tp + tp_rank (the grid's model-parallel rank): the
  engine's record; `module` is None with a pipeline, else the TP rank's whole state dict
  (`<global layer index>.<name>`);
- `*optim_states.pt`: ZeRO/optimizer state, absent from module-only checkpoints;
- with ZeRO-3, `zero_pp_rank_D_mp_rank_XX_model_states.pt` and `..._optim_states.pt` per data-parallel rank D
  instead: the module's tensors there are empty (partitioned), the weights live in the fp32 partitions of the
  optimizer files, which DeepSpeed's zero_to_fp32 consolidates (`zero3_model_states_file`).
The tied embedding / LM head is named `tied_modules.embed.weight` and lives in layer 0's files.
"""

from pathlib import Path
from typing import Optional

import deepspeed
from deepspeed.checkpoint import constants as ds

from hybrid3d.errors import ConversionError
from hybrid3d.model.hf_weights import TIED_KEY
from hybrid3d.parallel.layout import ParallelLayout

LATEST = "latest"
CONVERTED_TAG = "global_step0"  # what a trainer that has taken no step would name it
TIED_PREFIX = f"tied_modules.{TIED_KEY}."


def layer_file(tag_dir: Path, layer_index: int, tp_rank: int, tp: int) -> Path:
    """PipelineModule's name for a layer's file on a TP rank (the rank repr omits pipe and data)."""
    topology = ParallelLayout(tp, 1, 1).topology()
    rank_repr = topology.get_rank_repr(rank=topology.get_rank(pipe=0, data=0, model=tp_rank))
    return tag_dir / f"{ds.LAYER_FILE_PREFIX}{layer_index:02d}-{rank_repr}-model_states.pt"


def model_states_file(tag_dir: Path, stage: int, tp_rank: int, tp: int) -> Path:
    return tag_dir / f"{ds.MODEL_FILE_PREFIX}{stage * tp + tp_rank:02d}{ds.MODEL_FILE_SUFFIX}"


def zero3_model_states_file(tag_dir: Path, dp_rank: int, stage: int, tp_rank: int, tp: int) -> Path:
    """A ZeRO-3 engine's record of data-parallel rank `dp_rank` (DeepSpeed's `_get_zero_ckpt_name` form)."""
    return tag_dir / f"zero_pp_rank_{dp_rank}_mp_rank_{stage * tp + tp_rank:02d}{ds.MODEL_FILE_SUFFIX}"


def split_local_name(local_name: str) -> tuple[int, str]:
    """`3.mlp.up_proj.weight` -> (3, 'mlp.up_proj.weight'); the tied embedding -> (0, 'weight')."""
    if local_name.startswith(TIED_PREFIX):
        return 0, local_name[len(TIED_PREFIX):]
    index, key = local_name.split(".", 1)
    return int(index), key


def resolve_tag_dir(checkpoint_dir: Path, tag: Optional[str] = None) -> tuple[Path, str]:
    """The tag folder: `<dir>/<tag>`, `<dir>/<contents of latest>`, or `<dir>` itself when it is
    already a tag folder (holds `mp_rank_00_model_states.pt`)."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise ConversionError(f"{checkpoint_dir}: checkpoint folder not found")
    if tag is None:
        latest = checkpoint_dir / LATEST
        if latest.is_file():
            tag = latest.read_text().strip()
        elif model_states_file(checkpoint_dir, 0, 0, 1).is_file() or \
                zero3_model_states_file(checkpoint_dir, 0, 0, 0, 1).is_file():
            return checkpoint_dir, checkpoint_dir.name
        else:
            raise ConversionError(f"{latest}: not found (pass --tag, or a folder holding a DeepSpeed checkpoint)")
    tag_dir = checkpoint_dir / tag
    if not tag_dir.is_dir():
        raise ConversionError(f"{tag_dir}: checkpoint tag folder not found")
    return tag_dir, tag


def model_states_record(*, module, param_shapes, buffer_names, tp: int, pp: int, client_state: dict) -> dict:
    """The `mp_rank_XX_model_states.pt` content of a module-only checkpoint: the keys DeepSpeed's
    `_save_checkpoint` writes (`_common_checkpoint_state`), with no optimizer or scheduler state
    and step 0, plus `client_state` merged in at the top level, as `save_checkpoint` does."""
    record = dict(
        module=module,
        buffer_names=buffer_names,
        optimizer=None,
        param_shapes=[param_shapes],
        frozen_param_shapes=None,
        shared_params={},
        frozen_param_fragments=None,
        lr_scheduler=None,
        data_sampler=None,
        random_ltd=None,
        skipped_steps=0,
        global_steps=0,
        global_samples=0,
        dp_world_size=1,
        mp_world_size=tp * pp,
        ds_config=None,
        ds_version=deepspeed.__version__,
    )
    record[ds.CHECKPOINT_PARALLEL_DIMS] = {ds.CHECKPOINT_PP_DEGREE: pp, ds.CHECKPOINT_TP_DEGREE: tp}
    record.update(client_state)
    return record
