"""The ring's block kernels (hybrid3d/parallel/attention_blocks.py) against torch's SDPA: a block's output and
log-sum-exp, and the backward given the merged output and log-sum-exp of several blocks (the ring's use), with a
causal block, an additive document mask, rows that see no key, and the explicit kernel cut into many row tiles."""

import pytest
import torch
import torch.nn.functional as F

from hybrid3d.parallel import attention_blocks
from hybrid3d.parallel.attention_blocks import CpuFlashBlocks, ExplicitBlocks
from hybrid3d.parallel.ring_attention import _merge

KERNELS = {"cpu-flash": CpuFlashBlocks, "explicit": ExplicitBlocks}


def _inputs(n=24, b=2, h=3, d=8):
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64).float() for _ in range(3))
    dout = torch.randn(b, h, n, d)
    return q, k, v, dout


def _document_bias(n, b):
    """Two documents per row, split at different places; (b, 1, n, n) additive, causal inside each document."""
    doc = torch.zeros(b, n, dtype=torch.long)
    for row, split in enumerate((n // 3, n // 2)[:b]):
        doc[row, split:] = 1
    index = torch.arange(n)
    allowed = (index[None, :, None] >= index[None, None, :]) & (doc[:, :, None] == doc[:, None, :])
    return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf")).unsqueeze(1)


@pytest.fixture(params=[None, 7 * 1024])
def tiles(request, monkeypatch):
    """The explicit kernel whole, or in tiles of 12 rows (7 KiB of fp32 scores, 576 bytes a row of 2 x 3 x 24 keys)."""
    if request.param:
        monkeypatch.setattr(attention_blocks, "TILE_BYTES", request.param)
    return request.param


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS.keys())
@pytest.mark.parametrize("case", ["causal", "documents"])
def test_a_block_matches_sdpa_forward_and_backward(kernel, case, tiles):
    q, k, v, dout = _inputs()
    causal = case == "causal"
    bias = None if causal else _document_bias(q.shape[2], q.shape[0])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, attn_mask=bias, is_causal=causal)
    ref.backward(dout)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores + (bias if bias is not None else torch.full_like(scores, float("-inf")).triu(1))
    out, lse = kernel.forward(q, k, v, causal, bias)
    torch.testing.assert_close(out.float(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-6)
    grads = kernel.backward(dout, q, k, v, ref.detach(), lse, causal, bias)
    for name, got, leaf in zip("qkv", grads, leaves):
        torch.testing.assert_close(got.float(), leaf.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS.keys())
def test_blocks_merged_by_lse_match_one_attention_over_all_keys(kernel, tiles):
    """Keys in two blocks (the earlier segment whole, the query's own segment causal), merged by log-sum-exp;
    the backward of each block with the merged output and log-sum-exp sums to SDPA's gradients. The second
    query half's rows see no key of the masked first block: lse -inf there, as the ring corrects the CPU kernel's 0."""
    q_all, k_all, v_all, dout_all = _inputs(n=32)
    half = 16
    q, dout = q_all[:, :, half:], dout_all[:, :, half:]
    leaves = [t.clone().requires_grad_() for t in (q, k_all, v_all)]
    causal_all = torch.ones(32, 32, dtype=torch.bool).tril()
    causal_all[half + 8:, :half] = False  # the last 8 query rows may not see the first segment (another document)
    ref = F.scaled_dot_product_attention(*leaves, attn_mask=causal_all[half:])
    ref.backward(dout)
    before = torch.zeros(1, 1, half, half).masked_fill(~causal_all[half:, :half], float("-inf"))
    blind = ~causal_all[half:, :half].any(-1)[None, None]  # (1, 1, rows)
    out = torch.zeros(q.shape)
    lse = torch.full(q.shape[:3], float("-inf"))
    blocks = [(k_all[:, :, :half], v_all[:, :, :half], False, before), (k_all[:, :, half:], v_all[:, :, half:], True, None)]
    for k, v, causal, bias in blocks:
        o, l = kernel.forward(q, k, v, causal, bias)
        if bias is not None:
            l = l.masked_fill(blind, float("-inf"))
        out, lse = _merge(out, lse, o, l)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-6)
    dq = torch.zeros(q.shape)
    dk, dv = [], []
    for k, v, causal, bias in blocks:
        gq, gk, gv = kernel.backward(dout, q, k, v, out, lse, causal, bias)
        dq += gq
        dk.append(gk)
        dv.append(gv)
    for name, got, leaf in zip("qkv", (dq, torch.cat(dk, 2), torch.cat(dv, 2)), leaves):
        torch.testing.assert_close(got.float(), leaf.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_the_explicit_kernel_tiles_its_rows(monkeypatch):
    monkeypatch.setattr(attention_blocks, "TILE_BYTES", 7 * 1024)
    q = torch.zeros(2, 3, 24, 8)
    assert [(t.start, t.stop) for t in attention_blocks._row_tiles(q, 24)] == [(0, 12), (12, 24)]
    assert len(attention_blocks._row_tiles(q, 240)) == 24  # one row a tile when a row alone passes the budget


def _emulated_efficient(calls, broken=False):
    """torch's memory-efficient kernel's two entry points, emulated on the CPU for CudaBlocks' plumbing: its log-sum-
    exp padded to 32 rows as the CUDA kernel pads it; `broken` scales the output, as a kernel that fails the check."""

    def forward(q, k, v, causal):
        calls.append("fused")
        out, lse = CpuFlashBlocks.forward(q, k, v, causal, None)
        padded = torch.nn.functional.pad(lse, (0, -lse.shape[-1] % 32), value=float("nan"))
        return out * (1.5 if broken else 1.0), padded[..., :q.shape[2]]

    def backward(grad_out, q, k, v, out, lse, causal):
        return CpuFlashBlocks.backward(grad_out, q, k, v, out, lse, causal, None)

    return forward, backward


@pytest.mark.parametrize("broken", [False, True], ids=["passes-its-check", "fails-its-check"])
def test_cuda_blocks_take_the_fused_kernel_only_where_it_holds(monkeypatch, caplog, broken):
    """Unmasked blocks of 32k rows go to the fused kernel once it passes its check against the explicit one; masked
    and unaligned blocks, and every block when the check fails (one warning), run as explicit tiles. Either way
    the results are SDPA's."""
    calls = []
    forward, backward = _emulated_efficient(calls, broken)
    monkeypatch.setattr(attention_blocks, "_efficient_forward", forward)
    monkeypatch.setattr(attention_blocks, "_efficient_backward", backward)
    attention_blocks.fused_blocks_verified.cache_clear()
    assert attention_blocks.fused_blocks_verified("cpu", torch.float32, 8) is not broken  # the check, run once
    kernel = attention_blocks.CudaBlocks
    for n, case in ((32, "causal"), (24, "causal"), (32, "documents")):
        q, k, v, dout = _inputs(n=n)
        causal = case == "causal"
        bias = None if causal else _document_bias(n, q.shape[0])
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*leaves, attn_mask=bias, is_causal=causal)
        ref.backward(dout)
        calls.clear()
        out, lse = kernel.forward(q, k, v, causal, bias)
        grads = kernel.backward(dout, q, k, v, ref.detach(), lse, causal, bias)
        assert calls == (["fused"] if (n, case) == (32, "causal") and not broken else []), (n, case, calls)
        torch.testing.assert_close(out.float(), ref.detach(), rtol=1e-5, atol=1e-6)
        for name, got, leaf in zip("qkv", grads, leaves):
            torch.testing.assert_close(got.float(), leaf.grad, rtol=1e-5, atol=1e-6, msg=name)
    warnings = [r for r in caplog.records if "memory-efficient kernel is not used" in r.getMessage()]
    assert len(warnings) == (1 if broken else 0)
    attention_blocks.fused_blocks_verified.cache_clear()
