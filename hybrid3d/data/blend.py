"""The order in which a weighted blend draws its datasets: megatron-core's `build_blending_indices`, sample for sample.

The rule (megatron-core `datasets/helpers.cpp`): with weights w (normalised to sum 1) and c_k the samples taken from
dataset k before global sample i, sample i comes from the first k with the largest error w_k · max(i, 1) - c_k, and
is that dataset's sample c_k. The errors are computed in float64 exactly as there, so near-ties break the same way.

The rule is sequential: c at sample n depends on every choice before n. A run needs c at its first sample (a
resume at `samples_consumed`) and at the run's last (the epochs each dataset will take), which may be billions of
samples in: one Python step per sample is out of reach, so `taken_at` advances many stretches at once, as numpy
rows. Stretch l (of `LANE` samples) starts from a guess of c (w·t rounded to a total of t); two runs of the rule
that reach the same c at the same sample agree from then on, and a wrong guess meets the true sequence within a
few windows of the rarest dataset (about 1/min w samples). So each stretch's state `warm` samples in is checked
against a run from the previous stretch's end (which is right once the previous stretch is); a stretch that fails
is redone one sample at a time from that end. The answer is exact whatever the guesses; they only decide the cost,
O(n·K) numpy work in ~`LANE` Python steps instead of n.
"""

import math

import numpy as np

LANE = 4096  # samples per stretch
GROUP = 1 << 16  # stretches per numpy pass (memory: GROUP x K int64 a few times)
MARKS = 64  # counts kept at samples already reached


def normalised(weights) -> np.ndarray:
    """megatron-core's normalisation (`datasets/utils.normalize`): w / sum(w) in float64."""
    weights = np.asarray(weights, dtype=np.float64)
    return weights / np.sum(weights)


def blend_steps(weights: list, first: int, taken: list, count: int) -> tuple[np.ndarray, np.ndarray, list]:
    """(dataset (count,) int16, its sample (count,) int64, c after them) for samples first..first+count-1, from the
    counts `taken` before `first`: the rule itself, one sample at a time."""
    taken = [int(c) for c in taken]
    datasets, samples = np.empty(count, np.int16), np.empty(count, np.int64)
    others = range(1, len(weights))
    for j, i in enumerate(range(first, first + count)):
        x = float(i) if i > 1 else 1.0
        best, error = 0, weights[0] * x - taken[0]
        for k in others:
            e = weights[k] * x - taken[k]
            if e > error:  # strictly: the first dataset wins a tie
                best, error = k, e
        datasets[j], samples[j] = best, taken[best]
        taken[best] += 1
    return datasets, samples, taken


def _advance(weights: np.ndarray, start: np.ndarray, taken: np.ndarray, steps: int) -> np.ndarray:
    """The rule run `steps` samples on from each row (`start` (L,) samples, `taken` (L, K) counts), in place."""
    rows = np.arange(len(start))
    for s in range(steps):
        x = np.maximum(start + s, 1).astype(np.float64)
        taken[rows, np.argmax(weights * x[:, None] - taken, axis=1)] += 1  # argmax: the first on ties
    return taken


def _guess(weights: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Counts near w·t that total t: the floors, plus one for the largest remainders (minus for the smallest)."""
    exact = weights * start[:, None].astype(np.float64)
    taken = np.floor(exact).astype(np.int64)
    short = start - taken.sum(axis=1)
    rank = np.argsort(np.argsort(taken - exact, axis=1, kind="stable"), axis=1, kind="stable")  # 0: largest rest
    taken += rank < short[:, None]
    taken -= rank >= weights.size + np.minimum(short, 0)[:, None]
    return taken


class BlendIndex:
    """megatron-core's blending order for `weights` (normalised here), queried at any sample."""

    def __init__(self, weights):
        self.weights = normalised(weights)
        self._weights = [float(w) for w in self.weights]
        positive = self.weights[self.weights > 0]
        # how far a stretch runs before its state is compared: a few windows of the rarest dataset
        self.warm = int(min(max(64, math.ceil(8 / positive.min())), 1 << 16))
        self.lane = max(LANE, 4 * self.warm)
        # counts at samples already reached (a few, the latest kept): reads go forward, or back within a global batch
        self._marks = {0: np.zeros(len(self.weights), np.int64)}

    def steps(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, sample within it) of global samples first..first+count-1."""
        datasets, samples, taken = blend_steps(self._weights, first, self.taken_at(first), count)
        self._mark(first + count, np.asarray(taken, np.int64))
        return datasets, samples

    def taken_at(self, n: int) -> np.ndarray:
        """(K,) int64: the samples taken from each dataset before global sample n."""
        start = max(m for m in self._marks if m <= n)
        taken = self._marks[start].copy()
        while (n - start) // self.lane >= 2:  # else one Python step per sample is as cheap
            lanes = min((n - start) // self.lane, GROUP)
            taken = self._lanes(start, taken, lanes)
            start += lanes * self.lane
        taken = np.asarray(blend_steps(self._weights, start, taken, n - start)[2], np.int64)
        self._mark(n, taken)
        return taken.copy()

    def _mark(self, n: int, taken: np.ndarray) -> None:
        self._marks[n] = taken.copy()
        if len(self._marks) > MARKS:
            del self._marks[next(m for m in self._marks if m != 0)]  # the oldest (insertion order), never sample 0

    def _lanes(self, start: int, taken: np.ndarray, lanes: int) -> np.ndarray:
        """The counts `lanes` stretches after `start` (where they are `taken`)."""
        w, warm, lane = self.weights, self.warm, self.lane
        starts = start + np.arange(lanes, dtype=np.int64) * lane
        state = _guess(w, starts)
        state[0] = taken
        early = _advance(w, starts + 0, state, warm).copy()  # each stretch `warm` samples in
        ends = _advance(w, starts + warm, state, lane - warm)
        check = _advance(w, starts[1:], ends[:-1].copy(), warm)  # the same, from the previous stretch's end
        wrong = np.flatnonzero(~(check == early[1:]).all(axis=1)) + 1
        while wrong.size:
            l = int(wrong[0])
            redone = np.asarray(blend_steps(self._weights, int(starts[l]), ends[l - 1], lane)[2], np.int64)
            moved = not np.array_equal(redone, ends[l])
            ends[l] = redone
            wrong = wrong[1:]
            # a stretch checked against the old end of this one is checked again against the new end
            if moved and l + 1 < lanes and (not wrong.size or wrong[0] != l + 1):
                again = _advance(w, starts[l + 1:l + 2], ends[l:l + 1].copy(), warm)
                if not np.array_equal(again[0], early[l + 1]):
                    wrong = np.concatenate(([l + 1], wrong))
        return ends[-1].copy()
