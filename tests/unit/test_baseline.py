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
