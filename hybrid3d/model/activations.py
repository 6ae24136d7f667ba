"""What travels between layers besides the hidden states, as one tuple of tensors (what DeepSpeed's
PipelineEngine sends from stage to stage): (hidden, positions?, router_stats?).

- positions (b, s) int64: each token's position in its own document, present when packed documents are
  masked from each other (`hybrid3d.data.document_mask`); attention derives its block-diagonal mask and
  RoPE angles from them. Integer, so the pipeline engine sends no gradient for it.
- router_stats (2E + 1,) fp32: a mixture-of-experts model's routing sums (moe.py).

A layer reads the tuple with `split_activations` and writes it with `join_activations`; the two extras
are told apart by dtype (positions are integers, statistics floating point). A dense model without
document masking passes bare tensors, as before.
"""

from typing import Optional

import torch


def split_activations(inputs) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """A layer's input as (hidden, positions or None, router_stats or None)."""
    if not isinstance(inputs, tuple):
        return inputs, None, None
    hidden, positions, router_stats = inputs[0], None, None
    for extra in inputs[1:]:
        if extra.is_floating_point():
            router_stats = extra
        else:
            positions = extra
    return hidden, positions, router_stats


def join_activations(hidden: torch.Tensor, positions: Optional[torch.Tensor] = None,
                     router_stats: Optional[torch.Tensor] = None):
    """The inverse of `split_activations`: a bare tensor when there is nothing else to carry."""
    extras = tuple(x for x in (positions, router_stats) if x is not None)
    return (hidden, *extras) if extras else hidden
