"""hybrid3d: Llama training with tensor, pipeline and data (ZeRO) parallelism on DeepSpeed."""

__version__ = "0.1.0"
