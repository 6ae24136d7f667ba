"""Training data: local files through `datasets`, tokenization, Megatron-style packing, DP sharding."""

from hybrid3d.data.packing import DataCursor, PackedSamples, micro_batches
from hybrid3d.data.pipeline import TrainingData, build_training_data

__all__ = ["DataCursor", "PackedSamples", "TrainingData", "build_training_data", "micro_batches"]
