"""Cross entropy over vocab-sharded logits, without gathering them (Megatron-LM, Shoeybi et al. 2019, §3).

Per token, with z the logits spread over TP ranks:  loss = log(sum_j exp(z_j - m)) - (z_target - m),
m = max_j z_j. Each rank reduces its slice; two all-reduces over TP assemble the result: the max, then
the target logit and the sum of exps together in one (2, b, s) tensor (both are sums, both are known
once the max is). Padded vocabulary columns (index >= vocab_size) are masked to -inf,
so they change neither the loss nor the gradients.
"""

import torch
import torch.nn.functional as F
from deepspeed.comm import ReduceOp

from hybrid3d.parallel.rank_groups import TensorParallelGroup
from hybrid3d.parallel.tensor_parallel.mappings import all_gather_sequence, reduce_scatter_sequence, tp_all_reduce

IGNORE_INDEX = -100


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp, vocab_size, ignore_index):
        # logits: (b, s, V/t) this rank's vocabulary slice; target: (b, s) global ids.
        z = _without_padding(logits.float(), tp, vocab_size, owned=logits.dtype != torch.float32)

        z_max = z.max(dim=-1).values
        z_max = tp_all_reduce(z_max, tp, ReduceOp.MAX)
        z = z - z_max.unsqueeze(-1)

        local_target, outside = _local_targets(target, tp, logits.shape[-1])
        z_target = z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        # torch.where, not a product: a padded column holds -inf and -inf * 0 is NaN.
        z_target = torch.where(outside, torch.zeros_like(z_target), z_target)

        exp_z = z.exp_()
        sums = torch.stack((z_target, exp_z.sum(dim=-1)))  # (2, b, s): one all-reduce for both sums
        sums = tp_all_reduce(sums, tp)
        z_target, sum_exp = sums[0], sums[1]

        ignored = target == ignore_index
        loss = (sum_exp.log() - z_target).masked_fill(ignored, 0.0)  # (b, s)

        softmax = exp_z.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside, ignored)
        ctx.input_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside, ignored = ctx.saved_tensors
        # d loss / d z_j = softmax_j - 1[j == target]
        grad = softmax
        one_hot_value = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -one_hot_value)
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits, target, tp: TensorParallelGroup, vocab_size: int,
                                 ignore_index: int = IGNORE_INDEX):
    """Per-token loss (b, s) from vocab-sharded logits (b, s, V/t); ignored tokens give 0."""
    return _VocabParallelCrossEntropy.apply(logits, target, tp, vocab_size, ignore_index)


def token_loss_sum(logits, target, tp: TensorParallelGroup, vocab_size: int, ignore_index: int = IGNORE_INDEX):
    """(sum of the per-token losses, number of non-ignored tokens) over (b, s) targets.

    Without TP the logits hold the whole vocabulary and torch's fused cross entropy (one log-softmax
    pass, fp32) is the same function at lower cost: the vocab-parallel one makes several passes over the
    (b, s, V) logits to share its sums between ranks."""
    count = (target != ignore_index).sum()
    if tp.size == 1:
        z = logits[..., :vocab_size].float()  # (b, s, V): padded columns dropped
        return F.cross_entropy(z.flatten(0, 1), target.flatten(), ignore_index=ignore_index, reduction="sum"), count
    return vocab_parallel_cross_entropy(logits, target, tp, vocab_size, ignore_index).sum(), count


class _ChunkedVocabParallelLoss(torch.autograd.Function):
    """The LM head and the cross entropy together, `chunk` tokens at a time, keeping no (tokens, V/t) logits:
    forward keeps each token's log-sum-exp (fp32), backward recomputes each chunk's logits from it (one more head
    GEMM, the cost of the memory) and accumulates the input and weight gradients chunk by chunk (the approach of
    Liger-Kernel's fused linear cross entropy and Megatron's chunked output layer, with the logits recomputed rather
    than the gradients kept). Input handling as `column_linears`: x replicated over TP (its gradient all-reduced)
    or, with SP, this rank's sequence shard (gathered; its gradient reduce-scattered)."""

    @staticmethod
    def forward(ctx, x, weight, target, tp, vocab_size, ignore_index, chunk):
        # x (b, s, h) or (b, s/t, h) with SP; weight (V/t, h) this rank's vocabulary rows; target (b, s) global ids
        full = all_gather_sequence(x, tp) if tp.sequence_parallel else x
        rows = full.reshape(-1, full.shape[-1])  # (n, h)
        targets = target.reshape(-1)
        loss = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
        lse = torch.empty_like(loss)
        for part in _chunks(rows.shape[0], chunk):
            z = _chunk_logits(rows[part], weight, tp, vocab_size)  # (c, V/t) fp32, padding -inf
            z_max = z.max(dim=-1).values
            z_max = tp_all_reduce(z_max, tp, ReduceOp.MAX)
            local, outside = _local_targets(targets[part], tp, weight.shape[0])
            z_target = torch.where(outside, 0.0, z.gather(-1, local.unsqueeze(-1)).squeeze(-1) - z_max)
            sums = torch.stack((z_target, (z - z_max.unsqueeze(-1)).exp_().sum(dim=-1)))  # (2, c): one all-reduce
            sums = tp_all_reduce(sums, tp)
            loss[part] = (sums[1].log() - sums[0]).masked_fill(targets[part] == ignore_index, 0.0)
            lse[part] = z_max + sums[1].log()
        ctx.save_for_backward(x, weight, target, lse)
        ctx.tp, ctx.vocab_size, ctx.ignore_index, ctx.chunk = tp, vocab_size, ignore_index, chunk
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        x, weight, target, lse = ctx.saved_tensors
        tp = ctx.tp
        full = all_gather_sequence(x, tp) if tp.sequence_parallel else x
        rows = full.reshape(-1, full.shape[-1])
        targets = target.reshape(-1)
        scale = grad_loss.reshape(-1).float().masked_fill(targets == ctx.ignore_index, 0.0)  # (n,)
        grad_rows = torch.empty_like(rows)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for part in _chunks(rows.shape[0], ctx.chunk):
            # d loss / d z_j = softmax_j - 1[j == target], softmax from the forward's log-sum-exp
            grad_z = (_chunk_logits(rows[part], weight, tp, ctx.vocab_size) - lse[part].unsqueeze(-1)).exp_()
            local, outside = _local_targets(targets[part], tp, weight.shape[0])
            grad_z.scatter_add_(-1, local.unsqueeze(-1), -(~outside).float().unsqueeze(-1))
            grad_z = grad_z.mul_(scale[part].unsqueeze(-1)).to(rows.dtype)  # (c, V/t)
            grad_rows[part] = grad_z @ weight
            if ctx.needs_input_grad[1]:  # a frozen head (LoRA) needs no weight gradient
                grad_weight += (grad_z.t() @ rows[part]).float()
        grad_full = grad_rows.view(full.shape)
        if tp.sequence_parallel:
            grad_x = reduce_scatter_sequence(grad_full, tp)
        else:
            grad_x = tp_all_reduce(grad_full, tp)  # every rank's vocabulary slice contributes to each token's input
        grad_weight = grad_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight, None, None, None, None, None


def _chunks(n: int, chunk: int):
    return (slice(start, min(start + chunk, n)) for start in range(0, n, chunk))


def _chunk_logits(rows, weight, tp, vocab_size):
    """(c, h) x (V/t, h) -> (c, V/t) fp32 logits of this rank's vocabulary slice, padded columns -inf."""
    return _without_padding(F.linear(rows, weight).float(), tp, vocab_size, owned=True)


def _without_padding(z, tp, vocab_size: int, owned: bool):
    """z (..., V/t) fp32 logits of this rank's slice with its padded columns (index >= vocab_size) at -inf, written
    in place when `owned`, else in a copy."""
    padded_from = vocab_size - tp.rank * z.shape[-1]  # first local column that is padding
    if padded_from < z.shape[-1]:
        z = z if owned else z.clone()
        z[..., max(padded_from, 0):] = float("-inf")
    return z


def _local_targets(target, tp, per_rank: int):
    """(target index within this rank's slice, 0 where outside it; whether it lies outside)."""
    vocab_start = tp.rank * per_rank
    outside = (target < vocab_start) | (target >= vocab_start + per_rank)
    return (target - vocab_start).masked_fill(outside, 0), outside


def chunked_vocab_parallel_loss(x, weight, target, tp: TensorParallelGroup, vocab_size: int,
                                ignore_index: int = IGNORE_INDEX, chunk: int = 4096):
    """Per-token loss (b, s) of the LM head `weight` (V/t, h) applied to x (b, s, h), or x's sequence shard with
    SP, `chunk` tokens at a time, without keeping logits; ignored tokens give 0."""
    return _ChunkedVocabParallelLoss.apply(x, weight, target, tp, vocab_size, ignore_index, chunk)
