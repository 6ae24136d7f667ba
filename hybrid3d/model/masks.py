"""Attention masks beyond the plain causal one, as explicit boolean SDPA masks (True = may attend).

Sliding-window attention (Child et al. 2019; Mistral, Jiang et al. 2023): query i sees keys
i - window < j <= i, the last `window` positions including itself, as HF's `sliding_window_overlay`
combined with the causal mask. A window at least as long as the sequence masks nothing more than
causality, so `sliding_window_mask_or_none` returns None there and SDPA keeps its `is_causal` path.

The mask costs s² bytes, and SDPA keeps it for backward in every layer: `sliding_window_mask_or_none` hands
all layers (and all micro-batches) one shared tensor per (s, window, device), so a stage holds s² bytes,
not L·s². Callers must not modify it in place. On GPUs a boolean mask rules out the flash kernel; PyTorch
takes its memory-efficient one, still without an s² score matrix.

Document masking (packed sequences, Krell et al. 2021 "Efficient Sequence Packing without
Cross-contamination"; Llama 3's pre-training): a token attends only to earlier tokens of its own
document. The documents of a packed row are read off its positions: a document starts wherever the
position is 0, so the row's segment ids are the running count of zeros. With a window too, both apply.
"""

import functools
from typing import Optional

import torch


def sliding_window_mask(seq_len: int, window: int, device=None) -> torch.Tensor:
    """(s, s) bool: [i, j] True iff i - window < j <= i."""
    i = torch.arange(seq_len, device=device).unsqueeze(1)  # (s, 1) query positions
    j = torch.arange(seq_len, device=device).unsqueeze(0)  # (1, s) key positions
    return (j <= i) & (j > i - window)


def sliding_window_mask_or_none(seq_len: int, window: Optional[int], device=None) -> Optional[torch.Tensor]:
    """`sliding_window_mask`, or None when there is no window or it covers the whole sequence."""
    if window is None or window >= seq_len:
        return None
    return _shared_mask(seq_len, window, torch.device(device) if device is not None else torch.device("cpu"))


@functools.lru_cache(maxsize=8)  # a memo of a pure function: a few (s, window, device) keys per run
def _shared_mask(seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    return sliding_window_mask(seq_len, window, device)


def document_segments(positions: torch.Tensor) -> torch.Tensor:
    """(b, s) positions restarting at 0 per document -> (b, s) document index within the row."""
    return torch.cumsum(positions == 0, dim=-1)


def document_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """(b, s) positions -> (b, 1, s, s) bool, True where query i may attend key j: j <= i in the same document."""
    segments = document_segments(positions)
    same_document = segments.unsqueeze(-1) == segments.unsqueeze(-2)  # (b, s, s)
    s = positions.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=positions.device).tril()
    return (same_document & causal).unsqueeze(1)
