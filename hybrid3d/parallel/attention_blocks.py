"""The per-block attention kernels ring attention runs (parallel/ring_attention.py): one (query rows, key rows)
block at a time, forward returning the block's output and log-sum-exp, backward given the *merged* output and
log-sum-exp of all blocks (FlashAttention-2's per-block backward, Dao 2023: P = exp(S - lse),
dS = P ∘ (dP - rowsum(dO ∘ O))).

- `CpuFlashBlocks`: torch's fused flash-attention kernel for CPUs and its backward, which take and return the
  log-sum-exp (`_scaled_dot_product_flash_attention_for_cpu`).
- `ExplicitBlocks`: the same arithmetic written out in fp32 on any device, in tiles of query rows so that a tile's
  (b, h, rows, nk) scores stay under `TILE_BYTES`.
- `CudaBlocks`: torch's memory-efficient attention kernel (`_scaled_dot_product_efficient_attention` and its
  backward, called as torch's own ring attention calls them: `torch.distributed.tensor.experimental.
  _context_parallel`) for the unmasked blocks (whole or causal) whose rows are a multiple of 32 (the kernel pads
  its log-sum-exp to 32 rows), explicit tiles for the rest (documents, windows: the kernel's additive bias has
  alignment rules of its own). Before its first use on a device, dtype and head size it is checked against
  `ExplicitBlocks` on a small block, forward and backward; a kernel that fails the check or raises is not used
  again (one warning) and the explicit tiles run instead.

Every kernel takes q (b, h, nq, d) and k/v (b, h, nk, d) (kv heads already repeated to h), `causal` for a block of
a segment against itself (nq = nk, key j visible to query i iff j <= i), `bias` an additive mask broadcastable to
(b, h, nq, nk) or None, and the softmax scale 1/sqrt(d).
"""

import functools
import logging
import math

import torch

from hybrid3d.parallel.attention_visibility import visible

logger = logging.getLogger(__name__)

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
    if causal:  # a segment against itself: its local indices stand for positions
        query = torch.arange(rows.start, rows.stop, device=scores.device)
        key = torch.arange(scores.shape[-1], device=scores.device)
        scores = scores.masked_fill(~visible(query, key), float("-inf"))
    if bias is not None:
        scores = scores + bias[..., rows, :].float()
    return scores


class ExplicitBlocks:
    """Blockwise attention in explicit fp32 arithmetic, any device. A row that sees no key gets log-sum-exp -inf
    and output 0. Gradients come back in fp32."""

    LABEL = "explicit fp32 tiles"

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


def _efficient_forward(q, k, v, causal: bool):
    """torch's memory-efficient kernel: (out (b, h, nq, d) in q's dtype, lse (b, h, nq) fp32)."""
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)
    return out, lse[..., :q.shape[2]]


def _efficient_backward(grad_out, q, k, v, out, lse, causal: bool):
    """Its backward given the merged output and log-sum-exp; without dropout the Philox seed and offset go unused
    (as the forward returns them then: empty int64 scalars on the host)."""
    unused = torch.empty((), dtype=torch.int64)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out.contiguous(), q, k, v, None, out.contiguous(), lse.contiguous(), unused, unused, 0.0,
        [True, True, True, False], causal)
    return dq, dk, dv


@functools.lru_cache(maxsize=None)  # one check per (device, dtype, head size) in a process
def fused_blocks_verified(device: str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the fused kernel matches `ExplicitBlocks` on this device: a (1, 2, 64, head_dim) block, whole and
    causal, output, log-sum-exp and the three gradients within the dtype's rounding (fp32 2e-4, else 2e-2)."""
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v, grad_out = (torch.randn(1, 2, 64, head_dim, device=device, generator=generator).to(dtype)
                         for _ in range(4))
    tolerance = 2e-4 if dtype == torch.float32 else 2e-2
    try:
        for causal in (False, True):
            out, lse = _efficient_forward(q, k, v, causal)
            ref_out, ref_lse = ExplicitBlocks.forward(q, k, v, causal, None)
            grads = _efficient_backward(grad_out, q, k, v, out, lse, causal)
            ref_grads = ExplicitBlocks.backward(grad_out, q, k, v, out, lse, causal, None)
            for got, want in zip((out, lse, *grads), (ref_out, ref_lse, *ref_grads)):
                torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)
    except (RuntimeError, AssertionError) as e:
        logger.warning("ring attention: torch's memory-efficient kernel is not used on %s (%s, head size %d): %s; "
                       "its blocks run as explicit fp32 tiles", device, dtype, head_dim, str(e).splitlines()[0])
        return False
    return True


class CudaBlocks:
    """Unmasked blocks of 32k rows through torch's memory-efficient kernel once `fused_blocks_verified`, the
    others (and every block where it failed) as `ExplicitBlocks`."""

    LABEL = "torch's memory-efficient kernel, checked at first use (explicit fp32 tiles for masked blocks)"

    @staticmethod
    def _fused(q, bias) -> bool:
        return (bias is None and q.shape[2] % 32 == 0
                and fused_blocks_verified(str(q.device), q.dtype, q.shape[-1]))

    @staticmethod
    def forward(q, k, v, causal: bool, bias):
        if CudaBlocks._fused(q, bias):
            return _efficient_forward(q, k, v, causal)
        return ExplicitBlocks.forward(q, k, v, causal, bias)

    @staticmethod
    def backward(grad_out, q, k, v, out, lse, causal: bool, bias):
        if CudaBlocks._fused(q, bias):
            return _efficient_backward(grad_out, q, k, v, out, lse, causal)
        return ExplicitBlocks.backward(grad_out, q, k, v, out, lse, causal, bias)


def block_kernel(device: torch.device):
    """The kernel a ring's blocks run on `device`: torch's fused flash kernel on CPUs, its memory-efficient kernel
    (where it passes its check) on CUDA devices, explicit fp32 tiles elsewhere."""
    if device.type == "cpu":
        return CpuFlashBlocks
    return CudaBlocks if device.type == "cuda" else ExplicitBlocks
