"""LoRA adapters attached to a decoder block's projections, as `LlamaShape.lora_*` asks: which modules get one and
how each factor splits come from the TP plan (`tp_plan.lora_weights`, `lora_kinds`); the arithmetic is
`parallel/tensor_parallel/lora.py`'s."""

import dataclasses

from torch import nn

from hybrid3d.model.config import LlamaShape
from hybrid3d.model.tp_plan import COLUMN, LORA_TARGETS, ROW, lora_factor_shapes, lora_kinds, lora_weights
from hybrid3d.parallel.rank_groups import TensorParallelGroup
from hybrid3d.parallel.tensor_parallel.lora import attach_adapter

_SPLIT_DIM = {COLUMN: 0, ROW: 1}  # replicated: None


def with_adapters(shape: LlamaShape, rank: int, targets, **scaling) -> LlamaShape:
    """`shape` with LoRA adapters of rank r beside `targets` (PEFT module names, kept in the TP plan's order);
    `scaling`: `lora_alpha`, `lora_dropout` where the caller knows them (the memory model needs neither)."""
    return dataclasses.replace(shape, lora_rank=rank, lora_targets=tuple(m for m in LORA_TARGETS if m in targets),
                               **scaling)


def attach_block_adapters(owner: nn.Module, prefix: str, shape: LlamaShape, tp: TensorParallelGroup,
                          device=None, dtype=None) -> None:
    """Attach an adapter to each projection of `owner` (the block's `self_attn` or `mlp`, named by `prefix`) that
    `shape.lora_targets` names."""
    if not shape.lora_rank:
        return
    for _, _, base in lora_weights(shape, shape.lora_targets):
        if not base.startswith(prefix + "."):
            continue
        projection = base[len(prefix) + 1:-len(".weight")]  # q_proj, ..., down_proj
        (_, in_features), (out_features, _) = lora_factor_shapes(base, shape, 1, shape.lora_rank)
        a_kind, b_kind = lora_kinds(base, shape, tp.size)
        attach_adapter(getattr(owner, projection), out_features, in_features, _SPLIT_DIM.get(a_kind),
                       _SPLIT_DIM.get(b_kind), tp, shape.lora_rank, shape.lora_scale, shape.lora_dropout,
                       device=device, dtype=dtype)
