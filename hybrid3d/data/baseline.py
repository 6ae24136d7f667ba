"""The loss a model scores by knowing only token frequencies: the unigram entropy of a token stream.

H = -Σ_v p_v ln p_v (nats per token) with p_v the frequency of token v in the stream. A language model
whose loss stays near H has learned the frequencies and nothing of the context; the training job prints
H next to its losses so that a run's progress can be read against it.

The stream may be a memory-mapped pre-training corpus of billions of tokens: counts are taken in chunks
(no full-size copy), over at most the first `MAX_TOKENS` tokens, for a bounded start-up cost. At that
length the plug-in estimate's bias, about (V - 1)/(2N), is under 0.001 nats even for V = 128k; a prefix
is not a random sample of the corpus, though, and the job says when it counted only a prefix. For a blend, p is
the mixture Σ_k w_k p_k of its datasets' frequencies (each counted over its first MAX_TOKENS / K tokens): the
frequencies the blend's samples are drawn with.
"""

import numpy as np

from hybrid3d.data.blended import BlendedSamples

MAX_TOKENS = 1 << 27  # 134M tokens
CHUNK = 1 << 22


def unigram_counts(tokens, max_tokens: int = MAX_TOKENS, learn=None) -> np.ndarray:
    """Counts per token id of the first `max_tokens` of `tokens` (1-D integers), only where `learn` is 1 if given."""
    counts = np.zeros(0, dtype=np.int64)
    for start in range(0, min(len(tokens), max_tokens), CHUNK):
        stop = min(start + CHUNK, max_tokens)
        chunk = np.asarray(tokens[start:stop]).astype(np.int64, copy=False)
        if learn is not None:
            chunk = chunk[np.asarray(learn[start:stop]) == 1]
        chunk_counts = np.bincount(chunk)
        if len(chunk_counts) > len(counts):
            counts = np.pad(counts, (0, len(chunk_counts) - len(counts)))
        counts[:len(chunk_counts)] += chunk_counts
    return counts


def entropy(p: np.ndarray) -> float:
    """Entropy in nats of a distribution (or of counts, normalised here)."""
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum())


def unigram_entropy(tokens: np.ndarray, max_tokens: int = MAX_TOKENS) -> float:
    """Entropy in nats of the token frequencies of the first `max_tokens` of `tokens` (1-D integers)."""
    return entropy(unigram_counts(tokens, max_tokens))


def baseline_entropy(samples) -> tuple[float, str]:
    """(H, what was counted) of the training samples: their learned targets when a loss mask says which, else every
    token; a blend's (`blended.BlendedSamples`) mixed by its weights."""
    parts = ([(p.samples, w) for p, w in zip(samples.parts, samples.index.weights)]
             if isinstance(samples, BlendedSamples) else [(samples, 1.0)])
    limit = MAX_TOKENS // len(parts)
    mixture = np.zeros(0)
    for part, weight in parts:
        counts = unigram_counts(part.tokens, limit, part.learn)
        p = weight * counts / max(counts.sum(), 1)
        mixture = np.pad(mixture, (0, max(0, len(p) - len(mixture))))
        mixture[:len(p)] += p
    what = "training tokens" if all(part.learn is None for part, _ in parts) else "learned target tokens"
    if len(parts) > 1:
        what = f"blend's {what} (each dataset's frequencies, mixed by weight)"
    if any(len(part.tokens) > limit for part, _ in parts):
        what += f" (the first {limit:,}{' of each' if len(parts) > 1 else ''})"
    return entropy(mixture), what
