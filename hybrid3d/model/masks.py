"""Attention masks beyond the plain causal one, as SDPA masks: boolean (True = may attend), and the additive
form SDPA receives (`attention_bias`: 0 where a query may attend, -inf elsewhere, in the compute dtype).

Sliding-window attention (Child et al. 2019; Mistral, Jiang et al. 2023): query i sees keys
i - window < j <= i, the last `window` positions including itself, as HF's `sliding_window_overlay`
combined with the causal mask. A window at least as long as the sequence masks nothing more than
causality, so there is no mask there and SDPA keeps its `is_causal` path.

Document masking (packed sequences, Krell et al. 2021 "Efficient Sequence Packing without
Cross-contamination"; Llama 3's pre-training): a token attends only to earlier tokens of its own
document. The documents of a packed row are read off its positions: a document starts wherever the
position is 0, so the row's segment ids are the running count of zeros. With a window too, both apply.

Why additive, and why shared: SDPA turns a boolean mask into an additive one in the query's dtype on every call
(torch 2.13 `convert_boolean_attn_mask`, on CPU and GPU alike) and saves that copy for backward, so a boolean
mask costs each layer its own (b, 1, s, s) tensor. `attention_bias` hands every layer one additive tensor
instead: per (s, window, device, dtype) for a window, per micro-batch for documents (a function of the positions
tensor, which every block of a stage receives as the same object). A stage then holds b·s² elements of masks per
micro-batch, not L·b·s². Recomputation receives a detached copy of the positions and builds its own mask, freed
with that layer's backward. Callers must not modify a mask in place.
"""

import functools
import weakref
from typing import Optional

import torch

from hybrid3d.parallel.attention_visibility import visible


def sliding_window_mask(seq_len: int, window: int, device=None) -> torch.Tensor:
    """(s, s) bool: [i, j] True iff i - window < j <= i."""
    positions = torch.arange(seq_len, device=device)
    return visible(positions, positions, window)


def window_masks(seq_len: int, window: Optional[int]) -> bool:
    """Whether a sliding window masks more than causality does: it is shorter than the sequence."""
    return window is not None and window < seq_len


def sliding_window_mask_or_none(seq_len: int, window: Optional[int], device=None) -> Optional[torch.Tensor]:
    """`sliding_window_mask`, or None when there is no window or it covers the whole sequence."""
    return sliding_window_mask(seq_len, window, device) if window_masks(seq_len, window) else None


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask -> 0 where True, -inf where False, in `dtype`: what SDPA makes of a boolean mask."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def attention_bias(seq_len: int, window: Optional[int], positions: Optional[torch.Tensor], dtype: torch.dtype,
                   device) -> Optional[torch.Tensor]:
    """The additive mask for SDPA, shared by every layer (see the module's docstring), or None for plain causal
    attention: (s, s) for a window shorter than the sequence, (b, 1, s, s) with documents (`positions` (b, s))."""
    if positions is not None:
        return _document_bias(positions, window, dtype)
    return _window_bias(seq_len, window, torch.device(device), dtype) if window_masks(seq_len, window) else None


@functools.lru_cache(maxsize=8)  # a memo of a pure function: a few (s, window, device, dtype) keys per run
def _window_bias(seq_len: int, window: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return additive(sliding_window_mask(seq_len, window, device), dtype)


def document_segments(positions: torch.Tensor) -> torch.Tensor:
    """(b, s) positions restarting at 0 per document -> (b, s) document index within the row."""
    return torch.cumsum(positions == 0, dim=-1)


def document_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """(b, s) positions -> (b, 1, s, s) bool, True where query i may attend key j: j <= i in the same document."""
    index = torch.arange(positions.shape[-1], device=positions.device)
    return visible(index, index, segments=document_segments(positions))


# (id, version, window, dtype) of a live positions tensor -> a weak reference to its mask. The entry leaves when
# the positions tensor is freed; the mask lives only while a layer's autograd graph saves it (a checkpointed
# forward without grad keeps none, as the pipeline's input buffers would otherwise keep one per micro-batch).
_DOCUMENT_BIASES: dict = {}


def _document_bias(positions: torch.Tensor, window: Optional[int], dtype: torch.dtype) -> torch.Tensor:
    """Additive `document_causal_mask(positions)` (and the window's), one per positions tensor while it lives."""
    key = (id(positions), positions._version, window, dtype)
    held = _DOCUMENT_BIASES.get(key)
    bias = held() if held is not None else None
    if bias is None:
        mask = document_causal_mask(positions)  # (b, 1, s, s)
        windowed = sliding_window_mask_or_none(positions.shape[-1], window, positions.device)
        bias = additive(mask if windowed is None else mask & windowed, dtype)
        if held is None:
            weakref.finalize(positions, _DOCUMENT_BIASES.pop, key, None)
        _DOCUMENT_BIASES[key] = weakref.ref(bias)
    return bias
