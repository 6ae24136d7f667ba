"""Megatron-style tensor parallelism on the grid's slice (TP) group."""

from hybrid3d.parallel.tensor_parallel.column_linears import column_parallel_linears
from hybrid3d.parallel.tensor_parallel.cross_entropy import (
    IGNORE_INDEX,
    chunked_vocab_parallel_loss,
    token_loss_sum,
    vocab_parallel_cross_entropy,
)
from hybrid3d.parallel.rank_groups import ContextParallelGroup, TensorParallelGroup
from hybrid3d.parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    padded_vocab_size,
    vocab_parallel_logits,
)
from hybrid3d.parallel.tensor_parallel.mappings import (
    all_gather_sequence,
    copy_to_tp_region,
    gather_from_tp_region,
    leave_tp_region,
    reduce_from_tp_region,
    reduce_scatter_sequence,
    reduce_scatter_to_sequence_region,
    replicated_weight,
    scatter_to_tp_region,
)
from hybrid3d.parallel.tensor_parallel.random import seed_tensor_parallel_rng, tensor_parallel_rng

__all__ = [
    "IGNORE_INDEX", "ColumnParallelLinear", "ContextParallelGroup", "RowParallelLinear", "TensorParallelGroup",
    "VocabParallelEmbedding", "all_gather_sequence", "column_parallel_linears",
    "copy_to_tp_region", "gather_from_tp_region", "leave_tp_region", "padded_vocab_size",
    "reduce_from_tp_region", "reduce_scatter_sequence", "reduce_scatter_to_sequence_region", "replicated_weight",
    "scatter_to_tp_region", "token_loss_sum", "chunked_vocab_parallel_loss", "seed_tensor_parallel_rng", "tensor_parallel_rng", "vocab_parallel_cross_entropy",
    "vocab_parallel_logits",
]
