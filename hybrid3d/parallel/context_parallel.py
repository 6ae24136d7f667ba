"""Context parallelism's two rules outside attention: which positions a rank holds, and how the loss
of a sequence split over c ranks is assembled (DeepSpeed-Ulysses, Jacobs et al. 2023).

Each of the c ranks of a context-parallel group holds the contiguous positions [r·s/c, (r+1)·s/c) of
every sequence of its data shard. DeepSpeed sees the c ranks as data-parallel replicas (layout.py) and
averages gradients over all d·c of them, so each rank's loss carries c times its share of the sequence's
gradient: c · (its token-loss sum) / (the whole sequence's token count); averaged over the c ranks that is
the gradient of the sequence's mean loss. The value each rank returns is the whole sequence's mean, so
what the job logs does not depend on c.
"""

from typing import Optional

import deepspeed.comm as dist
import torch

from hybrid3d.parallel.rank_groups import ContextParallelGroup
from hybrid3d.parallel.ring_attention import ring_shard


def sequence_shard(x: torch.Tensor, cp: ContextParallelGroup) -> torch.Tensor:
    """(b, s, ...) -> (b, s/c, ...): this rank's contiguous positions; with ring attention its chunks r and
    2c-1-r of 2c (`ring_attention.ring_shard`)."""
    if cp.size == 1:
        return x
    s = x.shape[1]
    if s % (2 * cp.size if cp.ring else cp.size):
        raise ValueError(f"sequence length {s} is not divisible by context_parallel_size {cp.size}"
                         + (" x 2 (ring attention's two chunks a rank)" if cp.ring else ""))
    if cp.ring:
        return ring_shard(x, cp)
    return x[:, cp.rank * s // cp.size:(cp.rank + 1) * s // cp.size].contiguous()


def sequence_mean(local_sum: torch.Tensor, local_count: torch.Tensor, cp: ContextParallelGroup,
                  weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The token loss of sequences split over cp: Σ_ranks sum / Σ_ranks count (the micro-batch's mean), or
    Σ_ranks sum · `weight` when the caller normalises over more than this micro-batch (`weight` is then
    1 / the token count that the mean runs over, times the micro-batches it is spread over). The gradient flows
    through this rank's sum only, scaled by c (DeepSpeed then averages over the c ranks); no target gives 0."""
    if cp.size == 1:
        return local_sum * weight if weight is not None else local_sum / local_count.clamp(min=1)
    totals = torch.stack((local_sum.detach().float(), local_count.float()))  # (2,)
    dist.all_reduce(totals, group=cp.group)
    scaled = cp.size * local_sum
    value = scaled + (totals[0] - scaled.detach())  # Σ_ranks sum, with this rank's share of the gradient x c
    return value * weight if weight is not None else value / totals[1].clamp(min=1)
