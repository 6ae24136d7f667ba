"""The loss a model scores by knowing only token frequencies: the unigram entropy of a token stream.

H = -Σ_v p_v ln p_v (nats per token) with p_v the frequency of token v in the stream. A language model
whose loss stays near H has learned the frequencies and nothing of the context; the training job prints
H next to its losses so that a run's progress can be read against it.
"""

import numpy as np


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy in nats of the token frequencies of `tokens` (a 1-D integer array, memory-mapped is fine)."""
    counts = np.bincount(np.asarray(tokens).astype(np.int64, copy=False))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
