"""The experts' kernels (model/expert_kernels.py): grouped GEMMs against one GEMM per expert, forward and backward, and
what picks one."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybrid3d.errors import ConfigError
from hybrid3d.model.expert_kernels import GroupedSwiGLU, choose_kernel, loop_swiglu, sort_by_expert


class _Expert(nn.Module):
    """An expert as `moe.Expert` computes it (gate, up, down; silu(gate)·up)."""

    def __init__(self, h: int, f: int):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def partial(self, x):
        return F.linear(F.silu(F.linear(x, self.gate_proj.weight)) * F.linear(x, self.up_proj.weight),
                        self.down_proj.weight)


def _both(h: int, f: int, counts: list, dtype=torch.float32):
    """(outputs, input and weight gradients) of the loop and of GroupedSwiGLU on the same rows and weights (drawn in
    fp32, then cast to `dtype`)."""
    torch.manual_seed(0)
    experts = [_Expert(h, f).to(dtype) for _ in counts]
    rows = torch.randn(sum(counts), h).to(dtype)
    grad = torch.randn(sum(counts), h).to(dtype)
    results = []
    for grouped in (False, True):
        x = rows.clone().requires_grad_()
        weights = [w for e in experts for w in (e.gate_proj.weight, e.up_proj.weight, e.down_proj.weight)]
        for w in weights:
            w.grad = None
        y = GroupedSwiGLU.apply(x, counts, *weights) if grouped else loop_swiglu(x, counts, experts)
        y.backward(grad)
        results.append((y.detach(), [x.grad] + [w.grad.clone() for w in weights]))
    return results


def test_grouped_equals_the_loop_bit_for_bit_at_a_real_width():
    """Qwen3-30B-A3B's expert (h 2048, f_e 768) on uneven groups, one of them empty: the same output and every
    gradient to the bit (the empty expert's weights get zeros, as the loop gives them)."""
    (y_loop, g_loop), (y_grouped, g_grouped) = _both(2048, 768, [40, 33, 0, 61])
    assert torch.equal(y_loop, y_grouped)
    assert all(torch.equal(a, b) for a, b in zip(g_loop, g_grouped))
    assert all(not w.any() for w in g_grouped[7:10])  # expert 2's gate, up, down


def test_grouped_tracks_the_loop_within_silus_vector_tail():
    """At a width whose per-expert element counts end inside the CPU's vector step, silu over all rows and over
    each expert's differ in the tail's last bit (module docstring): the outputs stay within 1e-6 relative."""
    (y_loop, g_loop), (y_grouped, g_grouped) = _both(64, 48, [5, 0, 7, 3, 11])
    assert torch.allclose(y_loop, y_grouped, rtol=1e-6, atol=1e-7)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(g_loop, g_grouped))


def test_grouped_in_bf16_tracks_its_fp32_run():
    """bf16 grouped against the fp32 loop, as far as bf16's 8 bits go (and as the bf16 loop does)."""
    (y32, _), _ = _both(256, 128, [9, 17, 4])
    (y_loop16, _), (y16, _) = _both(256, 128, [9, 17, 4], torch.bfloat16)
    scale = y32.abs().max()
    assert (y16.float() - y32).abs().max() <= 2e-2 * scale
    assert (y16.float() - y32).abs().max() <= 2 * (y_loop16.float() - y32).abs().max() + 1e-3 * scale


def test_sort_by_expert_is_expert_by_expert_where():
    """The sorted assignments are what torch.where(indices == e) gives one expert after another; the capacity's
    sentinel expert E is left out."""
    indices = torch.tensor([[2, 0], [1, 2], [0, 3], [2, 1]])  # 4 tokens, k 2; 3 is the sentinel of E = 3
    order, counts = sort_by_expert(indices, 3)
    expected = torch.cat([torch.where(indices.reshape(-1) == e)[0] for e in range(3)])
    assert torch.equal(order, expected) and counts == [2, 2, 3]


def test_choice_and_refusal():
    """The default is the loop (any shape; as fast on this CPU: benchmarks/expert_kernels.py); grouped_mm where asked
    for, refused where its 16-byte strides do not hold."""
    assert choose_kernel(None, 2048, 768, 2)[0] == "loop"
    assert choose_kernel("grouped_mm", 2048, 768, 2)[0] == "grouped_mm"
    assert choose_kernel("loop", 2048, 768, 2)[0] == "loop"
    with pytest.raises(ValueError, match="hybrid3d.expert_kernel 'grouped_mm'.*16-byte strides"):
        choose_kernel("grouped_mm", 66, 48, 4)  # 264-byte rows


def test_grouped_mm_refused_in_one_line_where_it_cannot_run():
    from hybrid3d.config.support import check_expert_kernel
    from hybrid3d.model import LlamaShape

    shape = LlamaShape(vocab_size=203, hidden_size=60, intermediate_size=96, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, num_experts=4, experts_per_token=2, moe_intermediate_size=40,
                       expert_kernel="grouped_mm")
    check_expert_kernel(shape, 1, 4)  # 240- and 160-byte rows in fp32
    with pytest.raises(ConfigError, match="expert_kernel 'grouped_mm'.*16-byte strides"):
        check_expert_kernel(shape, 1, 2)  # 120 bytes in bf16
    check_expert_kernel(dataclasses.replace(shape, expert_kernel=None), 1, 2)  # the default, the loop, runs anywhere
