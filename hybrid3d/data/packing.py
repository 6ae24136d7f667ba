"""Megatron-style packing and data-parallel sharding.

Documents (each followed by EOS) are concatenated into one token stream t. With sequence length
s, sample i is t[i*s : i*s + s + 1]: input = its first s tokens, target = its last s. Global
batch k is samples [k*B, (k+1)*B); DP rank r takes its contiguous B/d share, in order, split into
micro-batches of m. Past the last sample the stream wraps around (the next epoch).
"""

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PackedSamples:
    tokens: np.ndarray  # (N,) the concatenated token stream, possibly memory-mapped
    seq_length: int

    def __len__(self) -> int:
        return max((len(self.tokens) - 1) // self.seq_length, 0)

    def sample(self, index: int) -> np.ndarray:  # (s + 1,)
        start = (index % len(self)) * self.seq_length
        return np.asarray(self.tokens[start:start + self.seq_length + 1])


def micro_batches(samples: PackedSamples, first_sample: int, global_batch: int, dp_rank: int, dp: int,
                  micro_batch: int):
    """Iterator over (input_ids, targets), each (m, s) int64, of DP rank `dp_rank` in the global batch of
    samples [first_sample, first_sample + global_batch): rank r reads its B/d consecutive samples."""
    share = global_batch // dp
    first = first_sample + dp_rank * share
    rows = np.stack([samples.sample(first + j) for j in range(share)]).astype(np.int64)  # (B/d, s+1)
    rows = torch.from_numpy(rows)
    for start in range(0, share, micro_batch):
        chunk = rows[start:start + micro_batch]
        yield chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


class DataCursor:
    """Where training is in the sample stream: the samples consumed so far (Megatron's `consumed_samples`).

    A checkpoint stores it, and a resumed run continues at the next unseen sample even when its global batch
    (or its DP size) differs from the run that saved; a step count alone would skip or repeat samples then."""

    def __init__(self, samples_consumed: int = 0):
        self.samples_consumed = samples_consumed

    def next_batch(self, global_batch: int) -> int:
        """The first sample of the next global batch, which is then consumed."""
        first = self.samples_consumed
        self.samples_consumed += global_batch
        return first
