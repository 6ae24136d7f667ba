"""LoRA in the planner (`--lora-rank`, `--lora-targets`): the shape it plans for and the header line saying what
is trained and what is frozen."""

import argparse

from hybrid3d.config.support import check_lora
from hybrid3d.model.adapters import with_adapters
from hybrid3d.model.config import LlamaShape
from hybrid3d.model.tp_plan import LORA_TARGETS
from hybrid3d.planning.parameters import adapter_parameters, model_parameters


def with_lora(shape: LlamaShape, rank: int, targets=tuple(LORA_TARGETS)) -> LlamaShape:
    """`shape` fine-tuned with LoRA adapters of rank r beside `targets` (PEFT module names, all 7 by default),
    as the trainer's shape carries them; rank 0: `shape` (full fine-tuning). A mixture-of-experts shape raises
    ConfigError (`config.support.check_lora`)."""
    if not rank:
        return shape
    check_lora(shape.is_moe, False)
    return with_adapters(shape, rank, targets)


def lora_line(shape: LlamaShape) -> str:
    """What a LoRA plan trains and freezes, for the command line's header."""
    return (f"LoRA rank {shape.lora_rank} on {', '.join(shape.lora_targets)}: {adapter_parameters(shape) / 1e6:.2f}M "
            f"adapter parameters trained; the {model_parameters(shape) / 1e9:.2f}B base frozen (bf16, no gradients "
            "or optimizer states; partitioned only by ZeRO-3); rel.time: full fine-tuning's step-time model")


def non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def lora_targets(text):
    targets = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if not targets or unknown:
        raise argparse.ArgumentTypeError(f"must be comma-separated modules of {', '.join(LORA_TARGETS)}, got {text!r}")
    return targets
