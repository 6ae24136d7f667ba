"""The client state hybrid3d stores in a checkpoint's `mp_rank_XX_model_states.pt`, and reading it back.

`universal_checkpoint_info` lets DeepSpeed's `ds_to_universal` reshard the checkpoint; the
`hybrid3d` entry carries the HF config, so a checkpoint can be exported to HF without its
original folder, and the layout it was written at. The training entry point can store the same
entry (`client_state(...)`) so its checkpoints export the same way.
"""

import json
from typing import Optional

from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
from transformers import AutoConfig

from hybrid3d.checkpoint.universal import universal_checkpoint_info
from hybrid3d.model.config import LlamaShape

SECTION = "hybrid3d"


def config_dict(hf_config) -> dict:
    """The full HF config as plain JSON types (what `torch.load(weights_only=True)` accepts)."""
    return json.loads(hf_config.to_json_string(use_diff=False))


def client_state(hf_config, shape: LlamaShape, tp: int, pp: int, *, converted_from: Optional[str] = None,
                 module_only: bool = False) -> dict:
    section = {
        "hf_config": config_dict(hf_config),
        "layout": {"tp": tp, "pp": pp},
        "vocab_pad_multiple": shape.vocab_pad_multiple,
        "module_only": module_only,
    }
    if converted_from is not None:
        section["converted_from"] = converted_from
    return {UNIVERSAL_CHECKPOINT_INFO: universal_checkpoint_info(shape, tp), SECTION: section}


def hf_config_from_section(section: dict):
    """The HF config stored by `client_state`, or None when the checkpoint has none."""
    stored = (section or {}).get("hf_config")
    return AutoConfig.for_model(**stored) if stored else None
