"""A weighted blend of packed datasets (`hybrid3d.data.blend`) read as one sample stream.

Global sample i is dataset k's sample j, (k, j) given by megatron-core's blending order (`blend.py`); each dataset
is packed as it would be alone and wraps around at its end (its next epoch), so a small dataset with a large weight
is seen several times. The order depends on the global sample number only: the same at any DP size, and resumed
by the data cursor's `samples_consumed` like a single dataset.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybrid3d.data.blend import BlendIndex
from hybrid3d.data.packing import PackedSamples

CHUNK = 4096  # samples whose (dataset, sample) are worked out at once
KEPT_CHUNKS = 4  # a global batch's reads go forward through at most a few chunks


@dataclass
class BlendPart:
    name: str  # for the console and metrics.jsonl: the path's file name, made unique
    samples: PackedSamples
    weight: float  # as configured (normalised by the index)
    account: str  # what the dataset holds, as the data: line of a single dataset says it


class BlendedSamples:
    """`PackedSamples`' reading interface (sample, targets, counted, positions) over a blend's parts."""

    def __init__(self, parts: list[BlendPart]):
        self.parts = parts
        self.seq_length = parts[0].samples.seq_length
        self.index = BlendIndex([p.weight for p in parts])
        self.every_target_counts = all(p.samples.every_target_counts for p in parts)
        self._chunks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __len__(self) -> int:  # one pass over every dataset
        return sum(len(p.samples) for p in self.parts)

    def _locate(self, index: int) -> tuple[PackedSamples, int]:
        chunk, at = divmod(index, CHUNK)
        if chunk not in self._chunks:
            if len(self._chunks) >= KEPT_CHUNKS:
                del self._chunks[min(self._chunks)]
            self._chunks[chunk] = self.index.steps(chunk * CHUNK, CHUNK)
        datasets, samples = self._chunks[chunk]
        return self.parts[int(datasets[at])].samples, int(samples[at])

    def sample(self, index: int) -> np.ndarray:
        part, j = self._locate(index)
        return part.sample(j)

    def counted(self, index: int, document_mask: bool) -> np.ndarray:
        part, j = self._locate(index)
        return part.counted(j, document_mask)

    def targets(self, index: int, document_mask: bool) -> np.ndarray:
        part, j = self._locate(index)
        return part.targets(j, document_mask)

    def positions(self, index: int) -> np.ndarray:
        part, j = self._locate(index)
        return part.positions(j)

    def lines(self, total_samples: int) -> list[str]:
        """Per dataset: what it holds, its normalised weight, and the epochs of it that `total_samples` take."""
        taken = self.index.taken_at(total_samples)
        return [f"  {p.name}: {p.account}; weight {w:.3f}; {t / len(p.samples):.2f} epochs in the run's "
                f"{total_samples:,} samples" for p, w, t in zip(self.parts, self.index.weights, taken)]


def part_names(paths: list[str]) -> list[str]:
    """A short unique name per dataset: the file name without its extension (a glob's pattern, a prefix's name),
    numbered when two are alike."""
    names = [Path(p.rstrip("/")).name.split(".")[0] or p for p in paths]
    return [f"{n}#{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]
