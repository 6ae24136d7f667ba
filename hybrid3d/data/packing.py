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


def micro_batches(samples: PackedSamples, batch_index: int, global_batch: int, dp_rank: int, dp: int,
                  micro_batch: int):
    """Iterator over (input_ids, targets), each (m, s) int64, of DP rank `dp_rank` in global batch
    `batch_index`."""
    share = global_batch // dp
    first = batch_index * global_batch + dp_rank * share
    rows = np.stack([samples.sample(first + j) for j in range(share)]).astype(np.int64)  # (B/d, s+1)
    rows = torch.from_numpy(rows)
    for start in range(0, share, micro_batch):
        chunk = rows[start:start + micro_batch]
        yield chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
