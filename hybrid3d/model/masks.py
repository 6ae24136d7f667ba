"""Attention masks beyond plain causal ones.

Document masking (packed sequences, as in Krell et al. 2021 "Efficient Sequence Packing without
Cross-contamination", and Llama 3's pre-training): a token attends only to earlier tokens of its own
document. The documents of a packed row are read off its positions: a document starts wherever the
position is 0, so the row's segment ids are the running count of zeros.
"""

import torch


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
