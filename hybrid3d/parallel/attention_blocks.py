"""The per-block attention kernels ring attention runs (parallel/ring_attention.py): one (query rows, key rows)
block at a time, forward returning the block's output and log-sum-exp, backward given the *merged* output and
log-sum-exp of all blocks (FlashAttention-2's per-block backward, Dao 2023: P = exp(S - lse),
dS = P ∘ (dP - rowsum(dO ∘ O))).

- `CpuFlashBlocks`: torch's fused flash-attention kernel for CPUs and its backward, which take and return the
  log-sum-exp (`_scaled_dot_product_flash_attention_for_cpu`).
- `ExplicitBlocks`: the same arithmetic written out in fp32 on any device, in tiles of query rows so that a tile's
  (b, h, rows, nk) scores stay under `TILE_BYTES`. It is what a ring runs on GPUs: torch's GPU flash and
  memory-efficient kernels return the log-sum-exp too, but their backward entry points are not wired here yet.

Every kernel takes q (b, h, nq, d) and k/v (b, h, nk, d) (kv heads already repeated to h), `causal` for a block of
a segment against itself (nq = nk, key j visible to query i iff j <= i), `bias` an additive mask broadcastable to
(b, h, nq, nk) or None, and the softmax scale 1/sqrt(d).
"""

import math

import torch

TILE_BYTES = 64 * 2**20  # one tile of fp32 scores (b, h, rows, nk) in ExplicitBlocks


class CpuFlashBlocks:
    """Torch's fused CPU flash-attention kernel. Its log-sum-exp of a row that sees no key is 0, not -inf: the ring
    corrects those rows before its merge."""

    LABEL = "torch's fused CPU flash kernel"

    @staticmethod
    def forward(q, k, v, causal: bool, bias):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias)
        return out, lse  # (b, h, nq, d) in q's dtype, (b, h, nq) fp32

    @staticmethod
    def backward(grad_out, q, k, v, out, lse, causal: bool, bias):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse.contiguous(), 0.0, causal, attn_mask=bias)


def _row_tiles(q, nk: int):
    """Slices of q's rows whose fp32 scores against nk keys fit TILE_BYTES."""
    b, h, nq, _ = q.shape
    rows = max(1, TILE_BYTES // (4 * b * h * max(nk, 1)))
    return [slice(start, min(start + rows, nq)) for start in range(0, nq, rows)]


def _scores(q_tile, k, rows: slice, causal: bool, bias):
    """fp32 scaled scores of the query rows `rows` against every key, masked: (b, h, len(rows), nk)."""
    scores = torch.matmul(q_tile.float(), k.float().transpose(-1, -2)) * (1.0 / math.sqrt(q_tile.shape[-1]))
    if causal:  # a segment against itself: key j visible to query i iff j <= i
        query = torch.arange(rows.start, rows.stop, device=scores.device)[:, None]
        key = torch.arange(scores.shape[-1], device=scores.device)[None, :]
        scores = scores.masked_fill(key > query, float("-inf"))
    if bias is not None:
        scores = scores + bias[..., rows, :].float()
    return scores


class ExplicitBlocks:
    """Blockwise attention in explicit fp32 arithmetic, any device. A row that sees no key gets log-sum-exp -inf
    and output 0. Gradients come back in fp32."""

    LABEL = "explicit fp32 tiles (no fused GPU kernel wired yet)"

    @staticmethod
    def forward(q, k, v, causal: bool, bias):
        b, h, nq, d = q.shape
        out = torch.empty(b, h, nq, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, h, nq, dtype=torch.float32, device=q.device)
        for rows in _row_tiles(q, k.shape[2]):
            scores = _scores(q[:, :, rows], k, rows, causal, bias)
            lse[:, :, rows] = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - lse[:, :, rows, None]).nan_to_num_(0.0)  # rows with no key: 0, not nan
            out[:, :, rows] = torch.matmul(probs, v.float())
        return out, lse

    @staticmethod
    def backward(grad_out, q, k, v, out, lse, causal: bool, bias):
        scale = 1.0 / math.sqrt(q.shape[-1])
        kf, vf = k.float(), v.float()
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        for rows in _row_tiles(q, k.shape[2]):
            q_tile, d_out = q[:, :, rows].float(), grad_out[:, :, rows].float()  # (b, h, r, d)
            probs = torch.exp(_scores(q_tile, kf, rows, causal, bias) - lse[:, :, rows, None]).nan_to_num_(0.0)
            dv += torch.matmul(probs.transpose(-1, -2), d_out)
            # rowsum(dO ∘ O) with the merged output O: the softmax's own term, over all blocks
            delta = (d_out * out[:, :, rows].float()).sum(-1, keepdim=True)  # (b, h, r, 1)
            d_scores = probs * (torch.matmul(d_out, vf.transpose(-1, -2)) - delta) * scale
            dq[:, :, rows] = torch.matmul(d_scores, kf)
            dk += torch.matmul(d_scores.transpose(-1, -2), q_tile)
        return dq, dk, dv


def block_kernel(device: torch.device):
    """The kernel a ring's blocks run on `device`: torch's fused flash kernel on CPUs, explicit fp32 elsewhere."""
    return CpuFlashBlocks if device.type == "cpu" else ExplicitBlocks
