"""The loss a model scores by knowing only token frequencies: the unigram entropy of a token stream.

H = -Σ_v p_v ln p_v (nats per token) with p_v the frequency of token v in the stream. A language model
whose loss stays near H has learned the frequencies and nothing of the context; the training job prints
H next to its losses so that a run's progress can be read against it.

The stream may be a memory-mapped pre-training corpus of billions of tokens: counts are taken in chunks
(no full-size copy), over at most the first `MAX_TOKENS` tokens, for a bounded start-up cost. At that
length the plug-in estimate's bias, about (V - 1)/(2N), is under 0.001 nats even for V = 128k; a prefix
is not a random sample of the corpus, though, and the job says when it counted only a prefix.
"""

import numpy as np

MAX_TOKENS = 1 << 27  # 134M tokens
CHUNK = 1 << 22


def unigram_entropy(tokens: np.ndarray, max_tokens: int = MAX_TOKENS) -> float:
    """Entropy in nats of the token frequencies of the first `max_tokens` of `tokens` (1-D integers)."""
    counts = np.zeros(0, dtype=np.int64)
    for start in range(0, min(len(tokens), max_tokens), CHUNK):
        chunk = np.asarray(tokens[start:min(start + CHUNK, max_tokens)]).astype(np.int64, copy=False)
        chunk_counts = np.bincount(chunk)
        if len(chunk_counts) > len(counts):
            counts = np.pad(counts, (0, len(chunk_counts) - len(counts)))
        counts[:len(chunk_counts)] += chunk_counts
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
