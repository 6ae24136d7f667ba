"""RMSNorm (Zhang & Sennrich 2019), computed in fp32 like HF's LlamaRMSNorm."""

from typing import Optional

import torch
from torch import nn

from hybrid3d.parallel.tensor_parallel import TensorParallelGroup, copy_to_tp_region, replicated_weight


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps); replicated over TP. (b, s, h) -> (b, s, h), or (b, s/t, h) with
    sequence parallelism, where the weight's gradient is summed over TP (`replicated_weight`)."""

    def __init__(self, hidden_size: int, eps: float, tp: Optional[TensorParallelGroup] = None,
                 device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.tp = tp or TensorParallelGroup.single()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x):
        input_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.tp_weight() * x.to(input_dtype)

    def tp_weight(self):
        """The weight as this rank multiplies by it; its gradient summed over TP with sequence parallelism."""
        return replicated_weight(self.weight, self.tp)


class HeadRMSNorm(RMSNorm):
    """Qwen3's q_norm / k_norm: RMSNorm over head_dim, one (d,) weight shared by every head.
    (b, s, heads/t, d) -> the same. Each TP rank normalises only its own heads, so its weight gradient
    is a partial sum over heads: backward sums it over TP (f on the weight), with or without
    sequence parallelism, as for k/v weights replicated over TP."""

    def tp_weight(self):
        return copy_to_tp_region(self.weight, self.tp)
