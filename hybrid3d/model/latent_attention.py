"""Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, §2.1; DeepSeek-V3, arXiv 2412.19437, §2.1.1), split
over TP by heads, in HF `DeepseekV3Attention`'s order of operations.

Keys and values come from one low-rank latent per token: kv_a_proj_with_mqa (h -> r_kv + d_r) gives the latent
c (r_kv) and one rotary key k_r (d_r) shared by every head; c is RMS-normalised and kv_b_proj (r_kv -> a·(d_n + d_v))
expands it into each head's non-rotary key (d_n) and value (d_v). Queries pass through a rank-r_q bottleneck
(q_a_proj -> q_a_layernorm -> q_b_proj, h -> r_q -> a·(d_n + d_r)), or a plain q_proj when q_lora_rank is null.
A head's query is [q_n; RoPE(q_r)], its key [k_n; RoPE(k_r)], its value v (d_v ≠ d_n + d_r); the softmax scale is
(d_n + d_r)^-1/2, times yarn's mscale(factor, mscale_all_dim)² under yarn with mscale_all_dim (the non-rotary dims
are scaled too, as DeepSeek's reference does). With `rope_interleave` the rotary dims are pairs (x0, x1), (x2, x3)
...; they are de-interleaved into halves first, which rotates them exactly as HF's interleaved formula does.

Tensor parallelism (as the dense attention, by heads): q_b_proj (or q_proj) and kv_b_proj are column-parallel, their
rows whole heads; o_proj is row-parallel. The down projections q_a_proj and kv_a_proj_with_mqa and the two latent
norms are replicated: every rank computes the same latents from the same x, and since each rank's heads read them
only through column-parallel layers (whose input gradient is summed over TP, f) and the shared rotary key (summed
over TP here), their gradients are whole, the same on every rank, and x's gradient is whole without a sum of its own.
"""

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from hybrid3d.model.config import LlamaShape
from hybrid3d.model.masks import attention_bias
from hybrid3d.model.norm import RMSNorm
from hybrid3d.model.rope import RotaryFrequencies, apply_rope, yarn_mscale
from hybrid3d.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, TensorParallelGroup,
                                               copy_to_tp_region, tensor_parallel_rng)
from hybrid3d.parallel.tensor_parallel.layers import init_shard_, normal_init


# The latent norms' epsilon: HF builds them with DeepseekV3RMSNorm's default, not the config's rms_norm_eps (as
# DeepSeek's reference model does)
LATENT_NORM_EPS = 1e-6


class ReplicatedLinear(nn.Module):
    """y = x Wᵀ with the whole W (out, in) on every TP rank (the latent down projections)."""

    def __init__(self, in_features: int, out_features: int, init, device=None, dtype=None):
        super().__init__()
        full = (out_features, in_features)
        self.weight = nn.Parameter(torch.empty(full, device=device, dtype=dtype))
        init_shard_(self.weight, full, 0, TensorParallelGroup.single(), init)

    def forward(self, x):
        return F.linear(x, self.weight)


def softmax_scale(shape: LlamaShape) -> float:
    """(d_n + d_r)^-1/2, times mscale(factor, mscale_all_dim)² under yarn with mscale_all_dim (module docstring)."""
    scale = shape.qk_head_dim ** -0.5
    scaling = shape.rope_scaling or {}
    if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


def deinterleave(x):
    """(..., d) pairs (x0, x1), (x2, x3), ... -> halves (x0, x2, ...; x1, x3, ...), RoPE's half-split layout."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentAttention(nn.Module):
    """(b, s, h) -> (b, s, h); positions (b, s) for packed documents masked from each other (`masks.py`)."""

    def __init__(self, shape: LlamaShape, tp: TensorParallelGroup, device=None, dtype=None):
        super().__init__()
        self.tp = tp
        self.heads = shape.num_heads // tp.size
        self.nope, self.rope, self.value = shape.qk_nope_head_dim, shape.head_dim, shape.v_head_dim
        self.latent = shape.kv_lora_rank
        self.interleaved = shape.rope_interleave
        self.dropout = shape.attention_dropout
        self.scale = softmax_scale(shape)
        h, a = shape.hidden_size, shape.num_heads
        init = normal_init(shape.initializer_range)
        kw = dict(device=device, dtype=dtype)
        qk = self.nope + self.rope
        if shape.q_lora_rank:  # registered in HF's order
            self.q_a_proj = ReplicatedLinear(h, shape.q_lora_rank, init, **kw)
            self.q_a_layernorm = RMSNorm(shape.q_lora_rank, LATENT_NORM_EPS, **kw)
            self.q_b_proj = ColumnParallelLinear(shape.q_lora_rank, a * qk, tp, init_method=init, **kw)
        else:
            self.q_proj = ColumnParallelLinear(h, a * qk, tp, init_method=init, **kw)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, self.latent + self.rope, init, **kw)
        self.kv_a_layernorm = RMSNorm(self.latent, LATENT_NORM_EPS, **kw)
        self.kv_b_proj = ColumnParallelLinear(self.latent, a * (self.nope + self.value), tp, init_method=init, **kw)
        self.o_proj = RowParallelLinear(a * self.value, h, tp, input_is_parallel=True, init_method=init, **kw)
        self.rotary = RotaryFrequencies(self.rope, shape.rope_theta, shape.rope_scaling)
        self.q_lora = bool(shape.q_lora_rank)

    def forward(self, x, positions=None):  # (b, s, h) -> (b, s, h)
        b, s, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(b, s, self.heads, self.nope + self.rope).transpose(1, 2)  # (b, a/t, s, d_n + d_r)
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.latent, self.rope], dim=-1)  # (b, s, r_kv), (b, s, d_r)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, s, self.heads, self.nope + self.value)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.value], dim=-1)  # (b, a/t, s, d_n), (b, a/t, s, d_v)
        k_rot = copy_to_tp_region(k_rot, self.tp).unsqueeze(1)  # (b, 1, s, d_r): f, every rank's heads read it
        if self.interleaved:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        cos, sin = self.rotary.cos_sin(s, x.device, x.dtype)  # (s, d_r)
        if positions is not None:  # each document from position 0, seeing only itself
            cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # (b, 1, s, d_r)
        q_rot, k_rot = apply_rope(q_rot, cos, sin), apply_rope(k_rot, cos, sin)
        q = torch.cat((q_nope, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, self.heads, -1, -1)), dim=-1)  # (b, a/t, s, d_n + d_r)
        mask = attention_bias(s, None, positions, q.dtype, q.device)  # None: causal
        dropout = self.dropout if self.training else 0.0
        with tensor_parallel_rng() if dropout else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None,
                                                 scale=self.scale)  # (b, a/t, s, d_v)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.value))
