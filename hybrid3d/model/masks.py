"""Attention masks beyond the plain causal one, as explicit boolean SDPA masks (True = may attend).

Sliding-window attention (Child et al. 2019; Mistral, Jiang et al. 2023): query i sees keys
i - window < j <= i, the last `window` positions including itself, as HF's `sliding_window_overlay`
combined with the causal mask. A window at least as long as the sequence masks nothing more than
causality, so `sliding_window_mask_or_none` returns None there and SDPA keeps its `is_causal` path.
"""

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
    return sliding_window_mask(seq_len, window, device)
