"""LoRA adapters beside tensor-parallel linears (Hu et al. 2021): y = W x + (alpha/r) · B A dropout(x).

The split of A (r x in) and B (out x r) is the TP plan's (`model/tp_plan.py LORA_SPLITS`); here is how each is
computed so that every gradient is the full one:

- column-parallel base (x replicated, or (b, s/t, in) with SP): z = A x runs through the base's own
  `column_parallel_linears` call (one f operator: the input gradient summed, or reduce-scattered, over TP once for
  base and adapters), with A behind `copy_to_tp_region` since every rank's B slice contributes to A's gradient;
  then delta = B_i z with this rank's output rows of B.
- row-parallel base (x_i = the rank's input features; `RowParallelLinear.adapter_delta`): u = g(A_i x_i) (the base's g: all-reduce, or
  reduce-scatter over the sequence with SP), delta = B u, B replicated (its gradient summed over TP under SP,
  where each rank holds other tokens: `replicated_weight`).
- replicated k/v base (t > kv heads): A and B replicated, B used at the rank's head rows (the base's rule).

Initialisation as PEFT's default: A ~ kaiming-uniform(a=√5) = U(-1/√in, 1/√in) drawn as the full matrix and
sliced (TP-size independent, as every weight here), B = 0, so training starts from the base model exactly.
Dropout (PEFT's `lora_dropout`) acts on the adapter's input only; on the TP stream wherever that input differs
between TP ranks (a row base's features, a sequence shard), on the default stream where it is replicated.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from hybrid3d.ds_internals.zero3 import full_numel
from hybrid3d.parallel.rank_groups import TensorParallelGroup
from hybrid3d.parallel.tensor_parallel.column_linears import column_parallel_linears
from hybrid3d.parallel.tensor_parallel.layers import adapter_dropout, has_adapter, init_shard_, mark_tensor_parallel
from hybrid3d.parallel.tensor_parallel.mappings import copy_to_tp_region

LORA_PARAMETER = ".lora_"  # in the name of every adapter parameter, and of nothing else


class LoRAFactor(nn.Module):
    """One factor (A or B) as a module holding `weight`, so parameters are named `<proj>.lora_A.weight` as PEFT
    names them. `split_dim`: the dim split over TP (None: replicated)."""

    def __init__(self, full_shape: tuple[int, int], split_dim, tp: TensorParallelGroup, init, device=None,
                 dtype=None):
        super().__init__()
        local = list(full_shape)
        if split_dim is not None:
            local[split_dim] //= tp.size
        self.weight = nn.Parameter(torch.empty(local, device=device, dtype=dtype))
        init_shard_(self.weight, full_shape, split_dim or 0, tp if split_dim is not None else TensorParallelGroup.single(),
                    init, always=True)
        if split_dim is not None:
            mark_tensor_parallel(self.weight, split_dim)


def kaiming_uniform_a(full: torch.Tensor) -> None:
    """PEFT's default A: `nn.init.kaiming_uniform_(A, a=math.sqrt(5))`, i.e. U(-1/√in, 1/√in)."""
    nn.init.kaiming_uniform_(full, a=math.sqrt(5))


def zeros(full: torch.Tensor) -> None:
    full.zero_()


def attach_adapter(linear: nn.Module, out_features: int, in_features: int, a_split, b_split,
                   tp: TensorParallelGroup, rank: int, scale: float, dropout: float, device=None, dtype=None) -> None:
    """Give `linear` (a Column/RowParallelLinear or a replicated k/v projection) `lora_A`, `lora_B` of rank r,
    split on `a_split` / `b_split` (a dim, or None for replicated), and its scale and dropout."""
    kw = dict(device=device, dtype=dtype)
    linear.lora_A = LoRAFactor((rank, in_features), a_split, tp, kaiming_uniform_a, **kw)
    linear.lora_B = LoRAFactor((out_features, rank), b_split, tp, zeros, **kw)
    linear.lora_scale, linear.lora_dropout = scale, dropout


def column_linears_with_adapters(x, weights: list, projections: list, tp: TensorParallelGroup,
                                 training: bool) -> tuple:
    """`column_parallel_linears(x, weights, tp)`, each output plus its projection's adapter delta where it has one.
    x (..., in), or (b, s/t, in) with SP -> ((..., out_i/t), ...)."""
    adapted = [i for i, p in enumerate(projections) if has_adapter(p)]
    if not adapted:
        return column_parallel_linears(x, weights, tp)
    a_weights = [copy_to_tp_region(projections[i].lora_A.weight, tp) for i in adapted]  # (r, in) each
    dropout = projections[adapted[0]].lora_dropout
    if dropout == 0 or not training:  # one call: the adapters share the base's input gradient reduction
        outs = column_parallel_linears(x, list(weights) + a_weights, tp)
        base, low = list(outs[:len(weights)]), outs[len(weights):]
    else:
        base = list(column_parallel_linears(x, weights, tp))
        low = column_parallel_linears(adapter_dropout(x, dropout, training, tp.sequence_parallel), a_weights, tp)
    for i, z in zip(adapted, low):  # z (..., r)
        projection = projections[i]  # B's rows of this rank's outputs: its own, or a replicated k/v head's
        b_rows = projection.head_lora_b() if hasattr(projection, "head_lora_b") else projection.lora_B.weight
        base[i] = base[i] + F.linear(z, b_rows) * projection.lora_scale
    return tuple(base)


def train_adapters_only(module: nn.Module) -> int:
    """Freeze every parameter but the adapters; returns how many adapter parameters stay trainable."""
    trainable = 0
    for name, param in module.named_parameters():
        param.requires_grad_(LORA_PARAMETER in name)
        trainable += full_numel(param) if param.requires_grad else 0
    return trainable
