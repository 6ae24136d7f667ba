"""Masked attention reaches a fused SDPA kernel on GPUs: with a mask (documents, a sliding window) the kv heads
are repeated before SDPA rather than passed with `enable_gqa`, which the memory-efficient and cuDNN kernels
refuse (the math kernel they would leave keeps the whole fp32 score matrix). The values are the same."""

import torch
import torch.nn.functional as F

from hybrid3d.model import LlamaShape
from hybrid3d.model.attention import CoreAttention

SDPA = F.scaled_dot_product_attention


def test_masked_attention_passes_no_enable_gqa_and_matches_torchs_gqa(monkeypatch):
    calls = []

    def spy(q, k, v, attn_mask=None, enable_gqa=False, **kwargs):
        calls.append((attn_mask is not None, enable_gqa, k.shape[1]))
        return SDPA(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa, **kwargs)

    torch.manual_seed(0)
    b, s, heads, kv, d = 2, 8, 4, 2, 8
    q, k, v = torch.randn(b, s, heads, d), torch.randn(b, s, kv, d), torch.randn(b, s, kv, d)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7]])  # two documents, then one
    shape = dict(vocab_size=64, hidden_size=heads * d, intermediate_size=64, num_layers=1, num_heads=heads,
                 num_kv_heads=kv, head_dim=d)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    for attention, pos in ((CoreAttention(LlamaShape(**shape)), positions),  # document mask
                           (CoreAttention(LlamaShape(**shape, sliding_window=3)), None),  # window < s
                           (CoreAttention(LlamaShape(**shape)), None)):  # causal, no mask
        calls.clear()
        got = attention(q, k, v, positions=pos)
        (masked, gqa, kv_heads), = calls
        assert (masked, gqa, kv_heads) == ((True, False, heads) if masked else (False, True, kv)), calls
        reference = _reference(attention, q, k, v, pos)  # torch's own GQA on the kv heads as they are
        torch.testing.assert_close(got, reference, rtol=0, atol=1e-6)


def _reference(attention, q, k, v, positions):
    from hybrid3d.model.masks import document_causal_mask, sliding_window_mask_or_none
    from hybrid3d.model.rope import apply_rope

    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    cos, sin = attention.rotary.cos_sin(q.shape[2], q.device, q.dtype)
    mask = sliding_window_mask_or_none(q.shape[2], attention.sliding_window, q.device)
    if positions is not None:
        cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        mask = document_causal_mask(positions) if mask is None else document_causal_mask(positions) & mask
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return SDPA(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True).transpose(1, 2)


def test_every_block_of_a_micro_batch_shares_one_document_mask():
    """A stage keeps one (b, 1, s, s) mask per micro-batch for backward, not one per layer: the blocks save the
    same tensor (SDPA saves the additive copy it makes of a boolean mask, so the shared mask is additive)."""
    from hybrid3d.model import LlamaSequential
    from hybrid3d.parallel.rank_groups import TensorParallelGroup

    b, s, layers = 2, 12, 3
    shape = LlamaShape(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=layers, num_heads=4,
                       num_kv_heads=2, head_dim=8, sliding_window=5)
    model = LlamaSequential(shape, TensorParallelGroup.single(), seed=0)
    ids = torch.randint(0, 64, (b, s))
    positions = torch.tensor([list(range(5)) + list(range(7)), list(range(12))])
    masks = []

    def pack(tensor):
        if tensor.shape == (b, 1, s, s):
            masks.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model((ids, positions)).float().sum().backward()
    assert len(masks) == layers  # every block saved a mask for its backward ...
    assert len({mask.data_ptr() for mask in masks}) == 1  # ... and it is one tensor (old code: one per block)
    # without grad (a checkpointed forward) nothing saves the mask, and the memo does not keep it alive either:
    # the pipeline's input buffers would otherwise hold one per micro-batch in flight
    from hybrid3d.model import masks as masks_module

    masks.clear()  # the hook's references: the graph that saved them is gone
    with torch.no_grad():
        model((ids, positions))
    assert masks_module._DOCUMENT_BIASES and all(ref() is None for ref in masks_module._DOCUMENT_BIASES.values())
