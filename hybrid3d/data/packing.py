"""Packing and data-parallel sharding.

Documents are concatenated into one token stream t. With sequence length s, sample i is t[i*s : i*s + s + 1]:
input = its first s tokens, target = its last s. Pre-training text is joined with EOS after each document
(Megatron's packing: documents run across sample boundaries). Fine-tuning examples are placed whole into the
s-token spans [i*s, (i+1)*s), in order, the rest of a span padded (`pipeline.py`), so an example never loses
its prompt to the previous sample. Global batch k is samples [k*B, (k+1)*B); DP rank r takes its contiguous
B/d share, in order, split into micro-batches of m. Past the last sample the stream wraps around (the next epoch).

Alongside the tokens the stream may carry, per token: `learn` (1 = a target the loss counts; none = all) and
`starts` (1 = a document's first token). A target is never counted when it starts a document and documents are
masked from each other (`document_mask`): it cannot be predicted from its own document.
"""

from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
import torch

from hybrid3d.errors import ConfigError
from hybrid3d.parallel.tensor_parallel.cross_entropy import IGNORE_INDEX


@dataclass
class PackedSamples:
    tokens: np.ndarray  # (N,) the concatenated token stream, possibly memory-mapped
    seq_length: int
    learn: Optional[np.ndarray] = None  # (N,) uint8, 1 where the token is a counted target; None = every token
    starts: Optional[np.ndarray] = None  # (N,) uint8, 1 at each document's first token

    def __len__(self) -> int:
        return max((len(self.tokens) - 1) // self.seq_length, 0)

    @property
    def every_target_counts(self) -> bool:
        """No loss mask: without document masking, a global batch counts B·s targets (nothing to read)."""
        return self.learn is None

    def _window(self, array: np.ndarray, index: int) -> np.ndarray:  # (s + 1,)
        start = (index % len(self)) * self.seq_length
        return np.asarray(array[start:start + self.seq_length + 1])

    def sample(self, index: int) -> np.ndarray:  # (s + 1,)
        return self._window(self.tokens, index)

    def counted(self, index: int, document_mask: bool) -> np.ndarray:
        """(s,) bool: the targets of sample `index` the loss counts (read from the masks only, not the tokens)."""
        counted = (np.ones(self.seq_length, dtype=bool) if self.learn is None
                   else self._window(self.learn, index)[1:] > 0)
        if document_mask and self.starts is not None:
            counted &= self._window(self.starts, index)[1:] == 0
        return counted

    def targets(self, index: int, document_mask: bool) -> np.ndarray:
        """(s,) int64 next-token targets of sample `index`, IGNORE_INDEX where the loss takes none."""
        window = self.sample(index).astype(np.int64)
        return np.where(self.counted(index, document_mask), window[1:], IGNORE_INDEX)

    def positions(self, index: int) -> np.ndarray:
        """(s,) int64: each input token's position in its document, restarting at 0 at every document start
        and at the sample's first token (a document cut by the sample boundary continues as a new one)."""
        s = self.seq_length
        starts = self._window(self.starts, index)[:s] > 0 if self.starts is not None else np.zeros(s, dtype=bool)
        starts[0] = True
        index_of_start = np.where(starts, np.arange(s), 0)
        return np.arange(s) - np.maximum.accumulate(index_of_start)


class MicroBatch(NamedTuple):
    """One micro-batch: ids and targets (m, s) int64; `positions` (m, s) int64 when documents are masked from each
    other; `loss_weight` () fp32 = (micro-batches in the global batch) / (counted targets in the global batch):
    the loss is the sum over counted targets times it, so that DeepSpeed's mean over micro-batches and DP ranks
    is the token-level mean over the global batch (as HF's loss over one batch with -100 labels, and HF's
    Trainer under gradient accumulation): every counted token weighs the same however the batch is split."""
    ids: torch.Tensor
    targets: torch.Tensor
    positions: Optional[torch.Tensor] = None
    loss_weight: Optional[torch.Tensor] = None


def micro_batches(samples: PackedSamples, first_sample: int, global_batch: int, dp_rank: int, dp: int,
                  micro_batch: int, document_mask: bool = False):
    """Iterator over the MicroBatch of DP rank `dp_rank` in the global batch of samples
    [first_sample, first_sample + global_batch): rank r reads its B/d consecutive samples' tokens. A generator:
    nothing is read until the engine asks for a micro-batch, which DeepSpeed's PipelineEngine does on the first
    and last stages only (`set_dataiterator`, deepspeed 0.19.8 runtime/pipe/engine.py:647)."""
    share = global_batch // dp
    first = first_sample + dp_rank * share
    ids = torch.from_numpy(np.stack([samples.sample(first + j)[:-1] for j in range(share)]).astype(np.int64))
    targets = np.stack([samples.targets(first + j, document_mask) for j in range(share)])
    if samples.every_target_counts and not document_mask:
        counted = global_batch * samples.seq_length
    else:  # the loss's denominator counts the whole global batch: the other shares' masks (1 byte a token), not
        # their tokens
        counted = int(sum(samples.counted(first_sample + j, document_mask).sum() for j in range(global_batch)))
    targets = torch.from_numpy(np.ascontiguousarray(targets))
    if counted == 0:
        raise ConfigError(f"hybrid3d.data: samples {first_sample}-{first_sample + global_batch - 1} (one global batch) "
                          "have no target to learn: every label is masked")
    weight = torch.tensor((global_batch // micro_batch) / counted, dtype=torch.float32)
    positions = (torch.from_numpy(np.stack([samples.positions(first + j) for j in range(share)]))
                 if document_mask else None)
    for start in range(0, share, micro_batch):
        rows = slice(start, start + micro_batch)
        yield MicroBatch(ids[rows].contiguous(), targets[rows].contiguous(),
                         None if positions is None else positions[rows].contiguous(), weight)


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
