"""Which keys a query may attend: the one rule behind the model's SDPA masks (`model/masks.py`) and ring attention's
blocks (`parallel/ring_attention.BlockMask`), here below both layers."""

from typing import Optional

import torch


def visible(query: torch.Tensor, key: torch.Tensor, window: Optional[int] = None,
            segments: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Which keys each query may attend, from their indices in the sequence: (nq,) and (nk,) -> (nq, nk) bool, True
    iff key <= query, with a `window` also query - window < key, and with `segments` (b, s) (`masks.document_segments`
    of the whole sequence) both in the same document, then (b, 1, nq, nk)."""
    i, j = query.unsqueeze(-1), key.unsqueeze(0)  # (nq, 1), (1, nk)
    allowed = j <= i
    if window is not None:
        allowed = allowed & (j > i - window)
    if segments is None:
        return allowed
    same_document = segments[:, query].unsqueeze(-1) == segments[:, key].unsqueeze(-2)  # (b, nq, nk)
    return (allowed & same_document).unsqueeze(1)
