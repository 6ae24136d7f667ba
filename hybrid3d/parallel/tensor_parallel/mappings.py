"""Autograd-aware collectives between the replicated and the tensor-parallel regions.

Megatron-LM (Shoeybi et al. 2019, §3, Fig. 3) names the two conjugate operators f and g:

- `copy_to_tp_region`  (f): identity forward, all-reduce backward. Enters a column-parallel region.
- `reduce_from_tp_region` (g): all-reduce forward, identity backward. Leaves a row-parallel region.
- `scatter_to_tp_region`: keep this rank's chunk of the last dim forward, all-gather backward.
- `gather_from_tp_region`: all-gather the last dim forward, keep this rank's chunk backward.

All collectives go through `deepspeed.comm` so DeepSpeed's comms logger counts them.
"""

import deepspeed.comm as dist
import torch

from hybrid3d.parallel.tensor_parallel.group import TensorParallelGroup


def _all_reduce(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    if tp.size == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=tp.group)
    return x


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


class _CopyToTPRegion(torch.autograd.Function):
    """f: identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.tp), None


class _ReduceFromTPRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward. The input is a partial sum no other op keeps (a
    row-parallel GEMM's or the embedding's output), so it is reduced in place, marked dirty."""

    @staticmethod
    def forward(ctx, x, tp):
        if not x.is_contiguous():
            return _all_reduce(x.contiguous(), tp)
        ctx.mark_dirty(x)
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


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


def scatter_to_tp_region(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    return x if tp.size == 1 else _ScatterToTPRegion.apply(x, tp)


def gather_from_tp_region(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    return x if tp.size == 1 else _GatherFromTPRegion.apply(x, tp)
