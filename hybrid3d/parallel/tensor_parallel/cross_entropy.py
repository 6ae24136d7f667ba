"""Cross entropy over vocab-sharded logits, without gathering them (Megatron-LM, Shoeybi et al. 2019, §3).

Per token, with z the logits spread over TP ranks:  loss = log(sum_j exp(z_j - m)) - (z_target - m),
m = max_j z_j. Each rank reduces its slice; two all-reduces over TP assemble the result: the max, then
the target logit and the sum of exps together in one (2, b, s) tensor (both are sums, both are known
once the max is). Padded vocabulary columns (index >= vocab_size) are masked to -inf,
so they change neither the loss nor the gradients.
"""

import deepspeed.comm as dist
import torch
import torch.nn.functional as F
from deepspeed.comm import ReduceOp

from hybrid3d.parallel.rank_groups import TensorParallelGroup

IGNORE_INDEX = -100


def _all_reduce(x, tp, op=ReduceOp.SUM):
    if tp.size > 1:
        dist.all_reduce(x, op=op, group=tp.group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp, vocab_size, ignore_index):
        # logits: (b, s, V/t) this rank's vocabulary slice; target: (b, s) global ids.
        per_rank = logits.shape[-1]
        vocab_start = tp.rank * per_rank
        z = logits.float()
        padded_from = vocab_size - vocab_start  # first local column that is padding
        if padded_from < per_rank:
            z = z.clone()
            z[..., max(padded_from, 0):] = float("-inf")

        z_max = z.max(dim=-1).values
        _all_reduce(z_max, tp, ReduceOp.MAX)
        z = z - z_max.unsqueeze(-1)

        outside = (target < vocab_start) | (target >= vocab_start + per_rank)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        z_target = z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        # torch.where, not a product: a padded column holds -inf and -inf * 0 is NaN.
        z_target = torch.where(outside, torch.zeros_like(z_target), z_target)

        exp_z = z.exp_()
        sums = torch.stack((z_target, exp_z.sum(dim=-1)))  # (2, b, s): one all-reduce for both sums
        _all_reduce(sums, tp)
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
