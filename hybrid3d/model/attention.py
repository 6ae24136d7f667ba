"""Causal self-attention with grouped-query heads, split over TP by heads.

Rank r holds query heads [r*a/t, (r+1)*a/t). Key/value heads:
- t <= kv heads: each rank holds its kv/t heads (column-parallel k_proj/v_proj);
- t  > kv heads (t a multiple of kv): each rank needs one kv head, shared by t/kv ranks. The
  full k/v weights are then replicated on every rank; a rank uses its head's rows, and the
  weight gradient (non-zero only in those rows) is summed over TP, giving every replica the
  full gradient (the same rule as a replicated parameter).

Per-family switches (`LlamaShape`): Qwen2's q/k/v biases follow their weights' rows (replicated with
them when t > kv heads); Qwen3's q/k RMSNorm runs per head before RoPE, its (d,) weights replicated
and their gradients summed over TP; Mistral's sliding window is a boolean SDPA mask (model/masks.py)
when it is shorter than the sequence.

Context parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023) splits the sequence over c more ranks:
each computes q/k/v for its s/c positions, `deepspeed.sequence.layer.DistributedAttention` exchanges
them all-to-all for all s positions of a/(t·c) heads, the core attends over the whole sequence, and
a second all-to-all returns the output to sequence shards. RoPE is applied inside the core, after the
exchange, so its positions are the global ones. GQA: a rank's kv heads are split over c with its
query heads; when c is a multiple of them, each kv head is repeated c/kv times first, so every CP rank
gets one (`context_kv_heads`).
"""

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from deepspeed.sequence.layer import DistributedAttention
from torch import nn

from hybrid3d.model.adapters import attach_block_adapters
from hybrid3d.model.config import LlamaShape
from hybrid3d.model.masks import attention_bias, document_segments, window_masks
from hybrid3d.model.norm import HeadRMSNorm
from hybrid3d.model.tp_plan import COLUMN, block_kind, context_kv_heads, kv_heads_per_rank
from hybrid3d.model.rope import RotaryFrequencies, apply_rope
from hybrid3d.parallel.tensor_parallel import (
    ColumnParallelLinear,
    ContextParallelGroup,
    RowParallelLinear,
    TensorParallelGroup,
    copy_to_tp_region,
    tensor_parallel_rng,
)
from hybrid3d.parallel.ring_attention import BlockMask, position_table, ring_attention
from hybrid3d.parallel.tensor_parallel.layers import init_shard_, normal_init
from hybrid3d.parallel.tensor_parallel.lora import column_linears_with_adapters


class ReplicatedKVProjection(nn.Module):
    """k_proj or v_proj when t > kv heads: full weight on every rank, this rank's head used."""

    def __init__(self, shape: LlamaShape, tp: TensorParallelGroup, device=None, dtype=None):
        super().__init__()
        self.tp = tp
        self.head_dim = shape.head_dim
        heads_per_kv = shape.num_heads // shape.num_kv_heads  # query heads per kv head
        first_q_head = tp.rank * (shape.num_heads // tp.size)
        self.kv_head = first_q_head // heads_per_kv
        full = (shape.num_kv_heads * shape.head_dim, shape.hidden_size)
        self.weight = nn.Parameter(torch.empty(full, device=device, dtype=dtype))
        init_shard_(self.weight, full, 0, TensorParallelGroup.single(), normal_init(shape.initializer_range))
        # Qwen2's bias: replicated like the weight, this rank's head's entries used
        self.bias = (nn.Parameter(torch.zeros(full[0], device=device, dtype=dtype)) if shape.qkv_bias
                     else None)

    def _head(self, tensor):  # backward: sum the head-sparse grads over TP
        return copy_to_tp_region(tensor, self.tp)[self.kv_head * self.head_dim:(self.kv_head + 1) * self.head_dim]

    def head_rows(self):  # (d, h): the rows of this rank's kv head, a view autograd tracks
        return self._head(self.weight)

    def head_bias(self):  # (d,) or None
        return None if self.bias is None else self._head(self.bias)

    def head_lora_b(self):  # (d, r): the rows of this rank's kv head in a LoRA adapter's replicated B
        return self._head(self.lora_B.weight)


class CoreAttention(nn.Module):
    """RoPE and causal SDPA over whole sequences: (b, s, heads, d) q and (b, s, kv, d) k, v -> (b, s, heads, d).
    With `positions` (b, s) (packed documents, `masks.py`) RoPE uses each token's position in its document and
    a token attends only within its document; SDPA then takes an explicit mask (no flash kernel on GPUs).

    With a mask the kv heads are repeated to the query heads before SDPA instead of passing `enable_gqa`: on
    GPUs the memory-efficient and cuDNN kernels take a mask but refuse `enable_gqa`, and the math kernel they
    would fall back to upcasts to fp32 and keeps the whole (b, heads, s, s) score matrix (torch 2.13
    `sdp_utils`). Without a mask `is_causal` with `enable_gqa` runs the flash kernel on the kv heads as they are."""

    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.dropout = shape.attention_dropout
        self.rotary = RotaryFrequencies(shape.head_dim, shape.rope_theta, shape.rope_scaling)
        self.sliding_window = shape.sliding_window

    def forward(self, q, k, v, positions=None):
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (b, heads, s, d)
        cos, sin = self.rotary.cos_sin(q.shape[2], q.device, q.dtype)  # positions 0..s-1 of the whole sequence
        if positions is not None:  # each document from position 0, seeing only itself
            cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # (b, 1, s, d)
        # (s, s) window or (b, 1, s, s) documents, additive and shared by the layers; None: causal
        mask = attention_bias(q.shape[2], self.sliding_window, positions, q.dtype, q.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = q.shape[1] // k.shape[1]  # query heads per kv head
        if mask is not None and group > 1:  # (b, kv, s, d) -> (b, heads, s, d), HF's repeat_kv order
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        dropout = self.dropout if self.training else 0.0
        # heads differ per TP (and CP) rank, so must their dropout masks; without dropout no stream is forked (the
        # fork copies the RNG tracker's states, which a compiled block could not trace)
        with tensor_parallel_rng() if dropout else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None,
                                                 enable_gqa=k.shape[1] != q.shape[1])  # no mask only
        return out.transpose(1, 2)  # (b, s, heads, d)


class RingCoreAttention(nn.Module):
    """RoPE at the global positions, then ring attention around the CP group's ring (parallel/ring_attention.py):
    (b, m, heads, d) q and (b, m, kv, d) k, v -> (b, m, heads, d), m the positions of this rank's ring member
    (its own s/c, or with a2a+p2p its Ulysses group's a2a·s/c after the all-to-all). With `positions` (b, s) of the
    whole sequence (packed documents) RoPE uses each token's position in its document and the ring's blocks are
    masked to documents; a sliding window shorter than the sequence masks them too."""

    def __init__(self, shape: LlamaShape, cp: ContextParallelGroup):
        super().__init__()
        self.rotary = RotaryFrequencies(shape.head_dim, shape.rope_theta, shape.rope_scaling)
        self.sliding_window = shape.sliding_window
        self.cp = cp

    def forward(self, q, k, v, positions=None):
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (b, heads, m, d)
        ring = self.cp.ring_members()
        s = q.shape[2] * ring.size
        table = position_table(self.cp, s, q.device)  # (ring size, m): every member's global positions
        cos, sin = self.rotary.cos_sin(s, q.device, q.dtype)  # positions 0..s-1 of the whole sequence
        mine = table[ring.rank]
        if positions is None:
            cos, sin = cos[mine], sin[mine]  # (m, d)
        else:  # each token at its position in its document: (b, 1, m, d)
            cos, sin = cos[positions[:, mine]].unsqueeze(1), sin[positions[:, mine]].unsqueeze(1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        mask = BlockMask(None if positions is None else document_segments(positions),
                         self.sliding_window if window_masks(s, self.sliding_window) else None)
        segment = s // (2 * self.cp.size)  # the runs of consecutive positions a rank holds (ring_attention.py)
        return ring_attention(q, k, v, table, segment, ring, mask).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape, tp: TensorParallelGroup, cp: Optional[ContextParallelGroup] = None,
                 device=None, dtype=None):
        super().__init__()
        self.tp = tp
        self.cp = cp or ContextParallelGroup.single()
        self.head_dim = shape.head_dim
        self.heads = shape.num_heads // tp.size
        self.kv_heads = kv_heads_per_rank(shape.num_kv_heads, tp.size)
        # kv heads after repetition for the context-parallel exchange (this rank's own without CP)
        # Ulysses' ranks: all of CP, none with a ring, the a2a_size inside each ring member with a2a+p2p
        ulysses = (self.cp.a2a_size if self.cp.ring else self.cp.size)
        self.exchanged_kv_heads = context_kv_heads(self.kv_heads, ulysses)
        init = normal_init(shape.initializer_range)
        h, d = shape.hidden_size, shape.head_dim
        kw = dict(device=device, dtype=dtype)
        bias = shape.qkv_bias  # Qwen2: q/k/v biases split with their heads
        self.q_proj = ColumnParallelLinear(h, shape.num_heads * d, tp, bias=bias, init_method=init, **kw)
        self.kv_replicated = block_kind("self_attn.k_proj.weight", shape, tp.size) != COLUMN
        if not self.kv_replicated:
            self.k_proj = ColumnParallelLinear(h, shape.num_kv_heads * d, tp, bias=bias, init_method=init, **kw)
            self.v_proj = ColumnParallelLinear(h, shape.num_kv_heads * d, tp, bias=bias, init_method=init, **kw)
        else:
            self.k_proj = ReplicatedKVProjection(shape, tp, **kw)
            self.v_proj = ReplicatedKVProjection(shape, tp, **kw)
        self.o_proj = RowParallelLinear(shape.num_heads * d, h, tp, input_is_parallel=True, init_method=init, **kw)
        # Qwen3: per-head RMSNorm of q and k before RoPE, weights replicated over TP
        self.q_norm = HeadRMSNorm(d, shape.rms_norm_eps, tp, **kw) if shape.qk_norm else None
        self.k_norm = HeadRMSNorm(d, shape.rms_norm_eps, tp, **kw) if shape.qk_norm else None
        self.core = CoreAttention(shape)
        self.ring_core = RingCoreAttention(shape, self.cp) if self.cp.ring else None
        # Ulysses on batch-first tensors: scatter the heads (dim 2), gather the sequence (dim 1)
        if self.cp.size > 1 and not self.cp.ring:
            self.context_parallel = DistributedAttention(self.core, self.cp.group, scatter_idx=2, gather_idx=1)
        elif self.cp.ring and self.cp.a2a_size > 1:  # a2a+p2p: Ulysses around the ring core
            self.context_parallel = DistributedAttention(self.ring_core, self.cp.a2a_group, scatter_idx=2,
                                                         gather_idx=1)
        else:
            self.context_parallel = None
        attach_block_adapters(self, "self_attn", shape, tp, **kw)  # LoRA, where shape.lora_targets asks

    def forward(self, x, positions=None):  # (b, s/c, h), or (b, s/(c·t), h) with SP -> the same; positions (b, s)
        if self.kv_replicated:
            kv_weights = [self.k_proj.head_rows(), self.v_proj.head_rows()]
            kv_biases = [self.k_proj.head_bias(), self.v_proj.head_bias()]
        else:
            kv_weights = [self.k_proj.weight, self.v_proj.weight]
            kv_biases = [self.k_proj.bias, self.v_proj.bias]
        # q/k/v share one input-gradient all-reduce, overlapped with their weight gradients
        qkv = column_linears_with_adapters(x, [self.q_proj.weight, *kv_weights],
                                           [self.q_proj, self.k_proj, self.v_proj], self.tp,
                                           self.training)  # SP: sequence gathered; LoRA deltas added
        q, k, v = (y if bias is None else y + bias for y, bias in zip(qkv, [self.q_proj.bias, *kv_biases]))
        b, s = q.shape[:2]  # s: this rank's s/c positions
        q = q.view(b, s, self.heads, self.head_dim)  # (b, s/c, a/t, d)
        k = k.view(b, s, self.kv_heads, self.head_dim)  # (b, s/c, kv/t, d)
        v = v.view(b, s, self.kv_heads, self.head_dim)
        if self.q_norm is not None:  # per head, so before the context-parallel exchange as well as after
            q, k = self.q_norm(q), self.k_norm(k)
        if self.cp.ring and self.context_parallel is None:  # ring attention: this rank's chunks, K/V around the ring
            out = self.ring_core(q, k, v, positions)
        elif self.context_parallel is None:
            out = self.core(q, k, v, positions)
        else:
            repeats = self.exchanged_kv_heads // self.kv_heads
            if repeats > 1:  # every CP rank needs a kv head of its own: (b, s/c, c, d)
                k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
            out = self.context_parallel(q, k, v, 0, positions=positions)  # all-to-all, core on (b, s, a/(t·c), d), all-to-all back
        return self.o_proj(out.reshape(b, s, self.heads * self.head_dim))
