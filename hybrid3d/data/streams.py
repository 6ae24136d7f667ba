"""Packed token streams made of a memory-mapped corpus's documents, read a window at a time.

`PackedSamples` (packing.py) reads its tokens, `starts` and `learn` arrays only by slices and lengths, so a stream
here stands in for each array without being built: a window [a, b) is assembled from the documents that cover it.

- `CorpusStream`: documents d0..d1-1 of an indexed corpus in stored order. The tokens are the `.bin` itself (a
  memory-mapped slice, no copy); document starts are found in the memory-mapped index.
- `PlacedStream`: documents in any order, each at its own offset of the stream (a seeded shuffle, or fine-tuning
  examples placed whole into s-token spans), the positions between two documents padded. The placement is three
  int64 arrays per document (source offset, length, stream offset), memory-mapped from the data cache, so every
  rank of a node shares one copy and nothing grows with the corpus's tokens.

In both, `starts` is 1 at a document's first token and at the first padding token after a document (padding is
a document of its own, as in pipeline.py), and `learn` (fine-tuning only) is the corpus's loss-mask sidecar, 0 at
each example's first token (never predicted from its own tokens) and on padding.
"""

import bisect
from typing import Optional

import numpy as np


class StreamView:
    """One array (`tokens`, `starts` or `learn`) of a stream: `len()` and `[a:b]` as a NumPy array would answer."""

    def __init__(self, stream, field: str, dtype):
        self.stream, self.field, self.dtype = stream, field, np.dtype(dtype)

    def __len__(self) -> int:
        return self.stream.total

    @property
    def shape(self) -> tuple:
        return (self.stream.total,)

    def __getitem__(self, key) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a stream is read by contiguous slices")
        start, stop, _ = key.indices(self.stream.total)
        return self.stream.window(self.field, start, max(start, stop))

    def __array__(self, dtype=None, copy=None):  # the whole stream: for tests and small data
        whole = self[0:len(self)]
        return whole if dtype is None else whole.astype(dtype)


class CorpusStream:
    """Documents [first, stop) of `corpus` (an `indexed.IndexedCorpus`) as stored: a pre-training stream."""

    learn = None

    def __init__(self, corpus, first: int = 0, stop: Optional[int] = None):
        self.corpus = corpus
        stop = len(corpus) if stop is None else stop
        self.begin, self.end = (int(x) for x in corpus.document_offsets(first, stop)[[0, -1]])
        self.first, self.stop = first, stop
        self.total = self.end - self.begin
        self.tokens = StreamView(self, "tokens", corpus.dtype)
        self.starts = StreamView(self, "starts", np.uint8)

    def window(self, field: str, a: int, b: int) -> np.ndarray:
        a, b = self.begin + a, self.begin + b
        if field == "tokens":
            return np.asarray(self.corpus.tokens[a:b])
        corpus, itemsize = self.corpus, np.dtype(self.corpus.dtype).itemsize
        if corpus.one_sequence_each:  # document offsets are the pointers (bytes)
            lo, hi = np.searchsorted(corpus.sequence_pointers, [a * itemsize, b * itemsize])
            offsets = np.append(np.asarray(corpus.sequence_pointers[lo:hi]) // itemsize,
                                corpus.document_offsets(hi, hi))
        else:  # offsets are non-decreasing in the document number: two bisections over the memory-mapped index
            def offset(d: int) -> int:
                return int(corpus.document_offsets(d, d)[0])

            lo = bisect.bisect_left(range(self.first, self.stop), a, key=offset) + self.first
            hi = bisect.bisect_left(range(lo, self.stop), b, key=offset) + lo
            offsets = corpus.document_offsets(lo, hi)
        opening = offsets[:-1][np.diff(offsets) > 0]  # the documents that open in [a, b); an empty one opens nothing
        starts = np.zeros(b - a, dtype=np.uint8)
        starts[opening - a] = 1
        return starts


class PlacedStream:
    """Documents of `source` (tokens, and `mask` for fine-tuning) placed at `dest` (increasing) in a stream of `total`
    positions: document p is source[src[p] : src[p] + length[p]]; other positions hold `pad`."""

    def __init__(self, source, src, length, dest, total: int, pad: int, mask=None):
        self.source, self.src, self.length, self.dest = source, src, length, dest
        self.total, self.pad, self.mask = int(total), pad, mask
        self.tokens = StreamView(self, "tokens", source.dtype)
        self.starts = StreamView(self, "starts", np.uint8)
        self.learn = StreamView(self, "learn", np.uint8) if mask is not None else None

    def window(self, field: str, a: int, b: int) -> np.ndarray:
        positions = np.arange(a, b, dtype=np.int64)
        if len(self.dest) == 0 or b == a:
            return np.full(b - a, self.pad if field == "tokens" else 0, dtype=np.dtype(self.source.dtype)
                           if field == "tokens" else np.uint8)
        lo, hi = np.searchsorted(self.dest, [a, b], side="right")
        lo = max(lo - 1, 0)
        dest, length, src = (np.asarray(x[lo:hi]) for x in (self.dest, self.length, self.src))
        which = np.clip(np.searchsorted(dest, positions, side="right") - 1, 0, None)
        offset = positions - dest[which]
        inside = (offset >= 0) & (offset < length[which])
        at = np.where(inside, src[which] + offset, 0)
        if field == "tokens":
            return np.where(inside, _gather(self.source, at), self.pad).astype(self.source.dtype)
        if field == "starts":
            return ((offset == 0) | (offset == length[which])).astype(np.uint8)
        return np.where(inside & (offset > 0), _gather(self.mask, at), 0).astype(np.uint8)


def _gather(array, at: np.ndarray) -> np.ndarray:
    """array[at] for positions that fall in a few contiguous runs: one slice of a memory-mapped array is read, not
    one page per position."""
    if at.size == 0:
        return np.zeros(0, dtype=array.dtype)
    low, high = int(at.min()), int(at.max()) + 1
    if high - low <= 4 * at.size:
        return np.asarray(array[low:high])[at - low]
    return np.asarray(array[at])
