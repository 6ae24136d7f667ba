"""Column-parallel GEMMs that share one input, with the f operator folded in and its backward
all-reduce overlapped with the weight-gradient GEMMs.

Megatron's f (`copy_to_tp_region`) all-reduces the input gradient over TP in the backward pass.
As a separate autograd op it runs after the input-gradient GEMMs and before the weight-gradient
GEMMs, and nothing else runs while it waits. Here one autograd function computes the input gradient
Σ_i dY_i A_i, starts its all-reduce (`async_op=True`), computes every dA_i = dY_iᵀ X while the
reduction is in flight, and waits last: Megatron-LM's `LinearWithGradAccumulationAndAsyncCommunication`
(Narayanan et al. 2021, §4; Megatron's `--async-tensor-model-parallel-allreduce`).

On CUDA the reduction runs on NCCL's stream while the GEMMs run on the compute stream; Megatron also
sets CUDA_DEVICE_MAX_CONNECTIONS=1 so that the all-reduce is queued before the GEMMs. hybrid3d leaves that
variable to the user, and the overlap on GPUs has not been measured yet.

Several weights in one call (q/k/v, gate/up) give one input-gradient all-reduce for all of them.
The input gradient is a fresh tensor this function owns, so it is reduced in place (no copy).

With sequence parallelism the input is this rank's sequence shard (b, s/t, in): forward all-gathers
it, and only the shard is saved for backward, which gathers it again (asynchronously, behind the
input-gradient GEMMs) for the weight gradients; the input gradient is reduce-scattered over the
sequence instead of all-reduced, again behind the weight-gradient GEMMs (Korthikanti et al. 2022, §4.2.2;
Megatron-LM's `LinearWithGradAccumulationAndAsyncCommunication` with `sequence_parallel`).
"""

import torch
import torch.nn.functional as F

from hybrid3d.parallel.rank_groups import TensorParallelGroup
from hybrid3d.parallel.tensor_parallel.mappings import all_gather_sequence, reduce_scatter_sequence, start_tp_all_reduce


class _ColumnParallelLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, *weights):  # x: (..., in) replicated, or (b, s/t, in) with SP; weight i: (out_i/t, in)
        ctx.tp = tp
        ctx.save_for_backward(x, *weights)
        full = all_gather_sequence(x, tp) if tp.sequence_parallel else x  # (..., in)
        return tuple(F.linear(full, w) for w in weights)  # each (..., out_i/t)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        tp = ctx.tp
        gathering = all_gather_sequence(x, tp, async_op=True) if tp.sequence_parallel else None
        # each (b·s, out_i/t); reshaped once: q/k/v's gradients arrive transposed, so this copies
        grads = [None if g is None else g.reshape(-1, g.shape[-1]) for g in grads]
        pairs = [(g, w) for g, w in zip(grads, weights) if g is not None]
        grad_x = reducing = None
        if ctx.needs_input_grad[0] and pairs:
            grad_x = pairs[0][0] @ pairs[0][1]  # (b·s, in)
            for g, w in pairs[1:]:
                grad_x.addmm_(g, w)
        full = x if gathering is None else gathering.wait()  # (..., in); the gather ran behind the GEMMs above
        if ctx.needs_input_grad[0]:
            if grad_x is None:
                grad_x = torch.zeros_like(full).view(-1, full.shape[-1])
            if tp.sequence_parallel:
                reducing = reduce_scatter_sequence(grad_x.view(full.shape), tp, async_op=True)
            else:
                reducing = start_tp_all_reduce(grad_x, tp)
        x2d = full.reshape(-1, full.shape[-1])  # (b·s, in)
        # computed while the reduction is in flight
        # frozen weights (a LoRA base) get none
        grad_weights = [None if g is None or not ctx.needs_input_grad[2 + i] else (g.t() @ x2d).to(w.dtype)
                        for i, (g, w) in enumerate(zip(grads, weights))]
        if tp.sequence_parallel and reducing is not None:
            grad_x = reducing.wait()  # (b, s/t, in)
        elif grad_x is not None:
            if reducing is not None:
                reducing.wait()
            grad_x = grad_x.view(x.shape)
        return (grad_x, None, *grad_weights)


def column_parallel_linears(x: torch.Tensor, weights: list, tp: TensorParallelGroup) -> tuple:
    """(F.linear(x, w) for w in weights) with f applied once to x: (..., in) -> ((..., out_i/t), ...);
    with sequence parallelism x is (b, s/t, in) and the outputs cover the whole sequence, (b, s, out_i/t).
    `weights` are column-parallel shards (out_i/t, in), or any tensors autograd tracks (a view of a
    replicated weight); their gradients are the local dY_iᵀ X, the input's is summed over TP."""
    if tp.size == 1:
        return tuple(F.linear(x, w) for w in weights)
    return _ColumnParallelLinears.apply(x, tp, *weights)
