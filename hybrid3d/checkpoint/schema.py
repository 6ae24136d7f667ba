"""What a hybrid3d checkpoint records about itself, in one place: the per-tag `hybrid3d.json` (`tag_record`) and the
`hybrid3d` entry of the client state inside DeepSpeed's model-states files (`client_state`); how each is built,
and how each is read back. Every writer (the training job, the HF converter, the saver) and every reader (resume,
the trainer, the converters) goes through these functions, so the two records cannot drift apart.

hybrid3d.json (written atomically by files.write_meta, readable without unpickling):
    layout       {tp, pp, dp, cp, ep, schedule, virtual, partition[, stage_bounds]}: the layout the files were written
                 at (`layout_record`): with a pipeline, how its layers were cut (`hybrid3d.partition_method`) and the
                 bounds that gave (layer-spec indices, every stage of the schedule's)
    shape        the model's LlamaShape as a dict; a resume must match its STRUCTURAL_FIELDS, the rest may change
    hf_config    the full HF config, so the checkpoint exports to HF without its original folder
    module_only  weights only (a converted HF model): a fresh optimizer at step 0, same TP x PP only
    step, samples_consumed   where training stood (`at_step`, per save; 0 for a converted model)
    files        the manifest: file -> bytes, written when the tag is committed (MANIFEST_KEY)

The client state's `hybrid3d` entry (CLIENT_SECTION) carries the HF config and layout for converted checkpoints,
and step, samples consumed and the RNG states for trained ones; DeepSpeed's universal-checkpoint info sits beside it.

What a resume may change: the layout (resharded through DeepSpeed's universal checkpoint, checkpoint/universal.py),
precision, optimizer and data settings, and any shape field outside STRUCTURAL_FIELDS (e.g. the vocabulary padding
of the model, which the universal checkpoint strips, or dropout). A MoE checkpoint resumes at its own layout only.
"""

import dataclasses
import json
from typing import Optional

from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

from hybrid3d.checkpoint.universal import universal_checkpoint_info
from hybrid3d.model.pipe import BLOCK_COUNT_PARTITION_METHOD, DEFAULT_PARTITION_METHOD
from hybrid3d.model.config import LlamaShape

CLIENT_SECTION = "hybrid3d"  # the client state's entry (not the DeepSpeed JSON's section of the same name)
MANIFEST_KEY = "files"  # in hybrid3d.json: file -> bytes, written when the tag is committed
# The shape fields that decide the tensors a checkpoint holds: a resume must match them all
STRUCTURAL_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "tie_word_embeddings", "qkv_bias", "qk_norm", "lora_rank", "lora_targets",
                     "num_experts", "moe_intermediate_size", "dense_layers", "shared_expert_intermediate_size",
                     "shared_expert_gate", "router_score_bias", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                     "v_head_dim")
LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")  # a LoRA run's adapters, in `shape`


def recorded_lora(record: Optional[dict]) -> dict:
    """The LoRA fields of a hybrid3d.json record's shape ({} for a full fine-tune or a record without a shape)."""
    shape = (record or {}).get("shape") or {}
    return {k: (tuple(shape[k]) if k == "lora_targets" else shape[k]) for k in LORA_FIELDS if k in shape} \
        if shape.get("lora_rank") else {}


def config_dict(hf_config) -> dict:
    """The full HF config as plain JSON types (what `torch.load(weights_only=True)` accepts)."""
    return json.loads(hf_config.to_json_string(use_diff=False))


def recorded_schedule(pp: int, schedule: str, virtual: int, partition: str = DEFAULT_PARTITION_METHOD) -> dict:
    """The pipeline schedule and partition method as a checkpoint's layout records them. Without a pipeline there
    is neither: 1F1B and "type:DecoderBlock", as every such checkpoint has recorded (the method then cuts nothing).
    A checkpoint saved before they were recorded was 1F1B cut by block count (`saved_schedule`)."""
    if pp == 1:
        return {"schedule": "1f1b", "virtual": 1, "partition": BLOCK_COUNT_PARTITION_METHOD}
    return {"schedule": schedule, "virtual": virtual, "partition": partition}


def saved_schedule(layout: dict) -> dict:
    """`recorded_schedule` of a saved layout, older checkpoints' values filled in (block count was the default
    method until "cost" became it)."""
    return {"schedule": layout.get("schedule", "1f1b"), "virtual": layout.get("virtual", 1),
            "partition": layout.get("partition", BLOCK_COUNT_PARTITION_METHOD)}


def layout_record(tp: int, pp: int, dp: int = 1, cp: int = 1, ep: int = 1, schedule: str = "1f1b",
                  virtual: int = 1, partition: str = DEFAULT_PARTITION_METHOD,
                  stage_bounds: Optional[list] = None, zero: Optional[int] = None) -> dict:
    """The layout a checkpoint was written at; `zero`: its ZeRO stage (stage 3 writes other files: a checkpoint
    without it was written below stage 3)."""
    record = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": ep, **recorded_schedule(pp, schedule, virtual, partition)}
    if zero is not None:
        record["zero"] = zero
    if pp > 1 and stage_bounds is not None:
        record["stage_bounds"] = [int(b) for b in stage_bounds]
    return record


def tag_record(layout: dict, shape: LlamaShape, hf_config, module_only: bool) -> dict:
    """hybrid3d.json's contents before `at_step` adds where training stood and the commit adds the manifest."""
    return {"layout": layout, "shape": dataclasses.asdict(shape), "hf_config": config_dict(hf_config),
            "module_only": module_only}


def at_step(record: dict, step: int, samples_consumed: int) -> dict:
    """`record` (a `tag_record`) of the checkpoint saved after `step` optimizer steps and `samples_consumed`."""
    return {**record, "step": step, "samples_consumed": samples_consumed}


def structure(shape_fields: dict) -> dict:
    """The STRUCTURAL_FIELDS of a shape (a LlamaShape's dict, or a record's `shape`)."""
    # a record read back from JSON holds lists where the shape holds tuples (lora_targets)
    return {k: list(shape_fields[k]) if isinstance(shape_fields[k], tuple) else shape_fields[k]
            for k in STRUCTURAL_FIELDS if k in shape_fields}


def saved_layout(record: dict) -> dict:
    return record["layout"]


def is_module_only(record: dict) -> bool:
    return bool(record.get("module_only", False))


def saved_step(record: dict) -> int:
    """The step a trained checkpoint stood at (0 for weights only)."""
    return 0 if is_module_only(record) else int(record.get("step", 0))


def manifest(record: dict) -> dict:
    return record.get(MANIFEST_KEY) or {}


def client_state(hf_config, shape: LlamaShape, tp: int, pp: int, *, converted_from: Optional[str] = None,
                 module_only: bool = False) -> dict:
    """The client state of a converted checkpoint: DeepSpeed's universal-checkpoint info and our section."""
    section = {"hf_config": config_dict(hf_config), "layout": {"tp": tp, "pp": pp},
               "vocab_pad_multiple": shape.vocab_pad_multiple, "module_only": module_only}
    if converted_from is not None:
        section["converted_from"] = converted_from
    return {UNIVERSAL_CHECKPOINT_INFO: universal_checkpoint_info(shape, tp), CLIENT_SECTION: section}


def training_client_state(step: int, samples_consumed: int, rng: dict) -> dict:
    """The client state a training save adds: where training stood and every generator's state."""
    return {CLIENT_SECTION: {"step": step, "samples_consumed": samples_consumed, "rng": rng}}


def client_section(client_state: Optional[dict]) -> dict:
    """Our entry of a loaded client state ({} when there is none)."""
    return (client_state or {}).get(CLIENT_SECTION) or {}


def hf_config_from_section(section: Optional[dict]):
    """The HF config stored by `client_state` (or a hybrid3d.json record), or None when there is none."""
    from transformers import AutoConfig

    stored = (section or {}).get("hf_config")
    return AutoConfig.for_model(**stored) if stored else None
