"""Unigram entropy, checked against hand-computed values."""

import math

import numpy as np
import pytest

from hybrid3d.data.baseline import unigram_entropy


def test_uniform_and_skewed():
    assert unigram_entropy(np.array([0, 1, 2, 3])) == pytest.approx(math.log(4))
    assert unigram_entropy(np.array([7, 7, 7])) == 0.0
    # p = (3/4, 1/4): H = -(3/4 ln 3/4 + 1/4 ln 1/4)
    assert unigram_entropy(np.array([5, 5, 5, 9], dtype=np.int32)) == pytest.approx(
        -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))


def test_chunks_and_the_prefix_cap(monkeypatch):
    import hybrid3d.data.baseline as baseline

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=10_000)
    monkeypatch.setattr(baseline, "CHUNK", 37)  # many chunks, the last one partial, growing vocab per chunk
    counts = np.bincount(tokens) / len(tokens)
    expected = -(counts[counts > 0] * np.log(counts[counts > 0])).sum()
    assert baseline.unigram_entropy(tokens) == pytest.approx(expected, rel=1e-12)
    # Only the prefix counts: a stream of one token repeated, then other tokens, past the cap.
    assert baseline.unigram_entropy(np.array([3] * 100 + [1, 2] * 50), max_tokens=100) == 0.0
