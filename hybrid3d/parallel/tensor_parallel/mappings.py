"""Autograd-aware collectives between the replicated and the tensor-parallel regions.

Megatron-LM (Shoeybi et al. 2019, §3, Fig. 3) names the two conjugate operators f and g:

- `copy_to_tp_region`  (f): identity forward, all-reduce backward. Enters a column-parallel region.
- `reduce_from_tp_region` (g): all-reduce forward, identity backward. Leaves a row-parallel region.
- `scatter_to_tp_region`: keep this rank's chunk of the last dim forward, all-gather backward.
- `gather_from_tp_region`: all-gather the last dim forward, keep this rank's chunk backward.

Sequence parallelism (Korthikanti et al. 2022, §4.2.2, Fig. 5) splits the activations between TP
regions along the sequence, (b, s/t, h), and replaces the pair by its decomposition: an all-reduce is
a reduce-scatter followed by an all-gather, so g becomes a reduce-scatter over the sequence
(`reduce_scatter_to_sequence_region`, all-gather backward) and f an all-gather (reduce-scatter
backward; `column_parallel_linears` folds it into the GEMMs). `all_gather_sequence` and
`reduce_scatter_sequence` are the collectives themselves, with `async_op` for overlapping them.

All collectives go through `deepspeed.comm` so DeepSpeed's comms logger counts them.
"""

import deepspeed.comm as dist
import torch
from deepspeed.comm import ReduceOp

from hybrid3d.parallel.rank_groups import TensorParallelGroup


def tp_all_reduce(x: torch.Tensor, tp: TensorParallelGroup, op=ReduceOp.SUM) -> torch.Tensor:
    """`x` reduced over TP, in place where it is contiguous (the result is returned either way). A SUM takes
    DeepSpeed's shared-memory kernel where the group allows it (`tp.shm_all_reduce`); the comms logger records
    an all_reduce either way."""
    if tp.size == 1:
        return x
    x = x.contiguous()
    if tp.shm_all_reduce and op == ReduceOp.SUM:
        dist.inference_all_reduce(x, group=tp.group)
    else:
        dist.all_reduce(x, op=op, group=tp.group)
    return x


def start_tp_all_reduce(x: torch.Tensor, tp: TensorParallelGroup):
    """Start summing the contiguous `x` over TP in place; returns the handle to wait on, or None when it is done
    already (TP 1, or DeepSpeed's shared-memory kernel, which takes microseconds: nothing to overlap). One named
    caller, so the comms logger's records of it classify as TP traffic (`ds_internals/comms_callers`)."""
    if tp.size == 1:
        return None
    if tp.shm_all_reduce:
        dist.inference_all_reduce(x, group=tp.group)
        return None
    return dist.all_reduce(x, group=tp.group, async_op=True)


def _split_last_dim(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    if tp.size == 1:
        return x
    if x.shape[-1] % tp.size:
        raise ValueError(f"last dim {x.shape[-1]} is not divisible by tensor-parallel size {tp.size}")
    return x.chunk(tp.size, dim=-1)[tp.rank].contiguous()


def _gather_last_dim(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    if tp.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x, group=tp.group)
    return torch.cat(parts, dim=-1)


class Pending:
    """An asynchronous sequence collective: `wait()` returns its result in (b, s..., ...) layout."""

    def __init__(self, handle, finish):
        self._handle, self._finish = handle, finish

    def wait(self) -> torch.Tensor:
        if self._handle is not None:
            self._handle.wait()
        return self._finish()


def all_gather_sequence(x: torch.Tensor, tp: TensorParallelGroup, async_op: bool = False):
    """(b, s/t, ...) -> (b, s, ...): this rank's sequence shard gathered over TP (rank order = sequence
    order). With `async_op` a `Pending`."""
    x = x.contiguous()
    # (t·b, s/t, ...): gloo wants the ranks' parts stacked along dim 0 of the output
    parts = torch.empty((tp.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    handle = dist.all_gather_into_tensor(parts, x, group=tp.group, async_op=async_op)

    def finish():
        stacked = parts.view(tp.size, *x.shape)  # (t, b, s/t, ...)
        return stacked.transpose(0, 1).reshape(x.shape[0], tp.size * x.shape[1], *x.shape[2:])  # (b, s, ...)

    return Pending(handle, finish) if async_op else finish()


def reduce_scatter_sequence(x: torch.Tensor, tp: TensorParallelGroup, async_op: bool = False):
    """(b, s, ...) partial sums -> (b, s/t, ...): summed over TP, this rank's sequence shard kept.
    With `async_op` a `Pending`."""
    b, s = x.shape[:2]
    if s % tp.size:
        raise ValueError(f"sequence length {s} is not divisible by tensor-parallel size {tp.size}")
    parts = x.reshape(b, tp.size, s // tp.size, *x.shape[2:]).transpose(0, 1).contiguous()  # (t, b, s/t, ...)
    out = torch.empty(parts.shape[1:], dtype=x.dtype, device=x.device)  # (b, s/t, ...)
    parts = parts.view(tp.size * b, *parts.shape[2:])  # (t·b, s/t, ...): rank r's part is rows [r·b, (r+1)·b)
    handle = dist.reduce_scatter_tensor(out, parts, group=tp.group, async_op=async_op)
    return Pending(handle, lambda: out) if async_op else out


class _CopyToTPRegion(torch.autograd.Function):
    """f: identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        return tp_all_reduce(grad.clone(), ctx.tp), None


class _ReduceFromTPRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward. The input is a partial sum no other op keeps (a
    row-parallel GEMM's or the embedding's output), so it is reduced in place, marked dirty."""

    @staticmethod
    def forward(ctx, x, tp):
        if not x.is_contiguous():
            return tp_all_reduce(x.contiguous(), tp)
        ctx.mark_dirty(x)
        return tp_all_reduce(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """g with sequence parallelism: reduce-scatter over the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, tp):  # (b, s, h) partial sums -> (b, s/t, h)
        ctx.tp = tp
        return reduce_scatter_sequence(x, tp)

    @staticmethod
    def backward(ctx, grad):  # (b, s/t, h) -> (b, s, h)
        return all_gather_sequence(grad, ctx.tp), None


class _ScatterToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _split_last_dim(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.tp), None


class _GatherFromTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _gather_last_dim(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.tp), None


def copy_to_tp_region(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    return x if tp.size == 1 else _CopyToTPRegion.apply(x, tp)


def reduce_from_tp_region(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    return x if tp.size == 1 else _ReduceFromTPRegion.apply(x, tp)


def reduce_scatter_to_sequence_region(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    return x if tp.size == 1 else _ReduceScatterToSequenceRegion.apply(x, tp)


def leave_tp_region(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """g, the end of a row-parallel region: the all-reduce, or with sequence parallelism its
    reduce-scatter over the sequence. (b, s, h) partial sums -> (b, s, h) or (b, s/t, h)."""
    return reduce_scatter_to_sequence_region(x, tp) if tp.sequence_parallel else reduce_from_tp_region(x, tp)


def replicated_weight(weight: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """A weight replicated over TP, used on a sequence shard: with sequence parallelism each rank's
    gradient covers its s/t tokens only, so backward sums it over TP (f on the weight) before the
    optimizer or ZeRO's hooks see it. DeepSpeed's optimizers do not do this (Megatron does it in its
    own optimizer: Megatron-DeepSpeed issue 170). Without SP the weight itself."""
    return copy_to_tp_region(weight, tp) if tp.sequence_parallel else weight


def scatter_to_tp_region(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    return x if tp.size == 1 else _ScatterToTPRegion.apply(x, tp)


def gather_from_tp_region(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    return x if tp.size == 1 else _GatherFromTPRegion.apply(x, tp)
