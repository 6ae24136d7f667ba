"""RMSNorm (Zhang & Sennrich 2019), computed in fp32 like HF's LlamaRMSNorm."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps); replicated over TP. (b, s, h) -> (b, s, h)."""

    def __init__(self, hidden_size: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x):
        input_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)
