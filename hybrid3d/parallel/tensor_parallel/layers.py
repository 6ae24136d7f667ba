"""Megatron-style tensor-parallel layers (Shoeybi et al. 2019, §3).

Every sharded parameter carries `tensor_model_parallel=True` (+ `partition_dim`) so DeepSpeed
counts it once per TP rank in gradient norms, while replicated parameters are counted once.

Weights are initialised as the full (unsharded) matrix from the default RNG, then sliced: all
TP ranks share that RNG state, so the model's initial weights do not depend on the TP size. The full matrix
is drawn on the accelerator when there is one (its generator is seeded with the host's, `model/layers.py
seed_layer`): at 7B a rank's stage is ~3.4e9 normal draws, ~20 s on one host thread and milliseconds on a GPU.
So a GPU run starts from other weights than a CPU run of the same seed, each independent of the layout.
Weights that are overwritten right after building (HF weights, a checkpoint) are not drawn at all
(`weights_loaded_later`).
"""

import contextlib
import contextvars
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from hybrid3d.parallel.tensor_parallel.column_linears import column_parallel_linears
from hybrid3d.parallel.rank_groups import TensorParallelGroup
from hybrid3d.parallel.tensor_parallel.random import tensor_parallel_rng
from hybrid3d.parallel.tensor_parallel.mappings import (
    gather_from_tp_region,
    leave_tp_region,
    replicated_weight,
    scatter_to_tp_region,
)

InitMethod = Callable[[torch.Tensor], None]

# Set while building a model whose every parameter is then loaded (`weights_loaded_later`).
_SKIP_DRAWS = contextvars.ContextVar("hybrid3d_skip_weight_draws", default=False)


@contextlib.contextmanager
def weights_loaded_later():
    """Within it, `init_shard_` fills parameters with zeros instead of drawing them: the caller loads every
    parameter next and must check that it did (`load_hf_state_dict` raises on any it did not fill; DeepSpeed's
    module load is strict)."""
    token = _SKIP_DRAWS.set(True)
    try:
        yield
    finally:
        _SKIP_DRAWS.reset(token)


def draw_device() -> torch.device:
    """Where full matrices are drawn: the current accelerator if there is one, else the host."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def normal_init(std: float, generator: Optional[torch.Generator] = None) -> InitMethod:
    """N(0, std) from `generator`, or from the default generator of the tensor's device."""
    return lambda w: nn.init.normal_(w, mean=0.0, std=std, generator=generator)


def padded_rows_init(init: InitMethod, rows: int) -> InitMethod:
    """`init` on the first `rows` rows of the full tensor (the real vocabulary), zero on the padding rows."""

    def padded(full):
        init(full[:rows])
        full[rows:].zero_()

    return padded


def has_adapter(linear: nn.Module) -> bool:
    """Whether `linear` carries a LoRA adapter (lora.py attaches `lora_A` and `lora_B`)."""
    return getattr(linear, "lora_A", None) is not None


def adapter_dropout(x, p: float, training: bool, differs_per_rank: bool):
    """A LoRA adapter's dropout on its input: on the TP stream where that input differs between TP ranks (a row
    base's features, a sequence shard), on the default stream where it is replicated (the same mask everywhere)."""
    if p == 0 or not training:
        return x
    if differs_per_rank:
        with tensor_parallel_rng():
            return F.dropout(x, p, True)
    return F.dropout(x, p, True)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor-parallel size {denominator}")
    return numerator // denominator


def mark_tensor_parallel(param: nn.Parameter, partition_dim: int) -> None:
    """Attributes DeepSpeed (`runtime/utils.py: is_model_parallel_parameter`) and checkpoint tools read."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = 1


def init_shard_(shard: torch.Tensor, full_shape, dim: int, tp: TensorParallelGroup, init: InitMethod,
                always: bool = False) -> None:
    """Fill `shard` with this rank's slice of a full tensor drawn by `init` (TP-size independent). `always`: draw
    even within `weights_loaded_later` (LoRA's factors, which a base model's weights do not overwrite)."""
    if shard.is_meta:
        return
    if _SKIP_DRAWS.get() and not always:
        with torch.no_grad():
            shard.zero_()
        return
    # new_empty, not torch.empty: under ZeRO-3's zero.Init, torch.empty makes tensors of the engine's dtype (bf16),
    # and the draw must be fp32 at any stage for the same initial weights
    full = shard.new_empty(full_shape, dtype=torch.float32, device=draw_device())
    init(full)
    local = full.chunk(tp.size, dim=dim)[tp.rank] if tp.size > 1 else full
    with torch.no_grad():
        shard.copy_(local)


class ColumnParallelLinear(nn.Module):
    """y = x A^T with A split by rows (output features) over TP: A = [A_1; ...; A_t].

    x: (..., in) replicated; output: (..., out/t), or (..., out) with `gather_output`.
    Layers that share an input (q/k/v, gate/up) call `column_parallel_linears` with all their
    weights instead of their own forward: one input-gradient all-reduce for all of them.
    """

    def __init__(self, in_features: int, out_features: int, tp: TensorParallelGroup, *, bias: bool = False,
                 gather_output: bool = False, init_method: Optional[InitMethod] = None, device=None, dtype=None):
        super().__init__()
        self.tp = tp
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = divide(out_features, tp.size, "output features")
        self.gather_output = gather_output
        init = init_method or normal_init(0.02)
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features, device=device, dtype=dtype))
        init_shard_(self.weight, (out_features, in_features), 0, tp, init)
        mark_tensor_parallel(self.weight, 0)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_per_rank, device=device, dtype=dtype))
            mark_tensor_parallel(self.bias, 0)
        else:
            self.register_parameter("bias", None)

    def forward(self, x):  # (..., in) -> (..., out/t)
        y, = column_parallel_linears(x, [self.weight], self.tp)
        y = y if self.bias is None else y + self.bias
        return gather_from_tp_region(y, self.tp) if self.gather_output else y

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features} (/{self.tp.size}), bias={self.bias is not None}"


class RowParallelLinear(nn.Module):
    """y = x A^T with A split by columns (input features) over TP: A = [A_1, ..., A_t].

    x: (..., in/t) when `input_is_parallel`, else (..., in) and scattered here;
    output: (..., out), summed over TP ranks (g operator); with sequence parallelism reduce-scattered
    over the sequence, (b, s/t, out). The bias is replicated.
    """

    def __init__(self, in_features: int, out_features: int, tp: TensorParallelGroup, *, bias: bool = False,
                 input_is_parallel: bool = True, init_method: Optional[InitMethod] = None,
                 device=None, dtype=None):
        super().__init__()
        self.tp = tp
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = divide(in_features, tp.size, "input features")
        self.input_is_parallel = input_is_parallel
        init = init_method or normal_init(0.02)
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, device=device, dtype=dtype))
        init_shard_(self.weight, (out_features, in_features), 1, tp, init)
        mark_tensor_parallel(self.weight, 1)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, x):  # (..., in/t) -> (..., out)
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp)
        y = leave_tp_region(F.linear(x, self.weight), self.tp)
        y = y if self.bias is None else y + replicated_weight(self.bias, self.tp)
        if has_adapter(self):
            y = y + self.adapter_delta(x)
        return y

    def adapter_delta(self, x):
        """(alpha/r) · B g(A_i dropout(x_i)), lora.py's rule for a row-parallel base: x (..., in/t) -> (..., out),
        or (b, s/t, out) with SP (the base's output layout)."""
        x = adapter_dropout(x, self.lora_dropout, self.training, self.tp.size > 1)
        low = leave_tp_region(F.linear(x, self.lora_A.weight), self.tp)  # (..., r): summed over TP (SP: scattered)
        return F.linear(low, replicated_weight(self.lora_B.weight, self.tp)) * self.lora_scale

    def extra_repr(self):
        return f"in={self.in_features} (/{self.tp.size}), out={self.out_features}, bias={self.bias is not None}"


def padded_vocab_size(vocab_size: int, tp_size: int, pad_multiple: int = 128) -> int:
    """Round the vocabulary up to a multiple of tp * pad_multiple (Megatron's
    `make-vocab-size-divisible-by`), so every TP rank holds an equal, aligned slice."""
    if pad_multiple < 1:
        raise ValueError(f"vocab pad multiple must be >= 1, got {pad_multiple}")
    multiple = tp_size * pad_multiple
    return int(math.ceil(vocab_size / multiple) * multiple)


class VocabParallelEmbedding(nn.Module):
    """Embedding with the (padded) vocabulary split in contiguous ranges over TP.

    ids: (b, s) -> (b, s, h). Each rank looks up the ids in its range, zeros the rest, and the
    partial results are summed over TP; with sequence parallelism reduce-scattered over the sequence,
    (b, s/t, h). Rows past `vocab_size` are padding, initialised to zero.
    """

    def __init__(self, vocab_size: int, embedding_dim: int, tp: TensorParallelGroup, *, pad_multiple: int = 128,
                 init_method: Optional[InitMethod] = None, device=None, dtype=None):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.padded_vocab_size = padded_vocab_size(vocab_size, tp.size, pad_multiple)
        self.per_rank = self.padded_vocab_size // tp.size
        self.vocab_start = tp.rank * self.per_rank
        self.vocab_end = self.vocab_start + self.per_rank
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim, device=device, dtype=dtype))
        init_shard_(self.weight, (self.padded_vocab_size, embedding_dim), 0, tp,
                    padded_rows_init(init_method or normal_init(0.02), vocab_size))
        mark_tensor_parallel(self.weight, 0)

    def forward(self, ids):  # (b, s) -> (b, s, h), or (b, s/t, h) with SP
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_tp_region(out, self.tp)

    def extra_repr(self):
        return (f"vocab={self.vocab_size} (padded {self.padded_vocab_size}, /{self.tp.size}), "
                f"dim={self.embedding_dim}")


def vocab_parallel_logits(hidden, weight, tp: TensorParallelGroup):
    """LM-head logits from a vocab-sharded weight: (b, s, h) x (V/t, h) -> (b, s, V/t).

    Used by the untied head (a ColumnParallelLinear) and by the tied head, which reuses the
    VocabParallelEmbedding weight."""
    logits, = column_parallel_linears(hidden, [weight], tp)
    return logits
