"""The activation model of the blocks that differ between families (planning/block_activations.py), against the
bytes hybrid3d's own blocks keep for backward: each MoE family's dense and expert blocks, DeepSeek-V3's latent
attention and Qwen3's q/k norms, in bf16 and fp32, block by block, to the byte.

A saved tensor counts if its storage is still alive once the forward has run: what a dead branch of the graph saved
(DeepSeek-V3's group-limited choice, whose indices carry no gradient) is freed during the forward, and a storage
freed there may be reused by a later one, which a count by address alone would merge with it."""

import dataclasses
import weakref
from collections import Counter

import pytest
import torch

from hybrid3d.model import LlamaSequential
from hybrid3d.model.config import LlamaShape
from hybrid3d.parallel.groups import TensorParallelGroup
from hybrid3d.planning.activations import (activation_bytes, activation_bytes_per_layer,
                                           input_layer_activation_bytes, output_layer_activation_bytes,
                                           shared_rope_bytes)
from tests.tiny_families import family_config
from tests.tiny_mixtral import MOE_FAMILIES

B, S = 2, 16
VARIANTS = {  # name: (family, HF config overrides)
    "mixtral": ("mixtral", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-no-renormalise": ("qwen3_moe", dict(norm_topk_prob=False)),
    "qwen2_moe": ("qwen2_moe", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3-no-q-lora": ("deepseek_v3", dict(q_lora_rank=None)),
    "deepseek_v3-one-group": ("deepseek_v3", dict(n_group=1, topk_group=1)),
    "qwen3": ("qwen3", {}),
}


def hf_config(family: str, overrides: dict):
    if family in MOE_FAMILIES:
        config_class, _, fields = MOE_FAMILIES[family]
        return config_class(**{**fields, **overrides})
    return family_config(family, **overrides)


def kept_bytes_per_block(model: LlamaSequential, ids) -> Counter:
    """{layer index: bytes of the distinct non-parameter storages its forward saved that are alive afterwards}."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    current, saved = [None], []
    hooks = [layer.register_forward_pre_hook(lambda module, args, i=i: current.__setitem__(0, i))
             for i, layer in enumerate(model.layers)]

    def pack(tensor):
        saved.append((weakref.ref(tensor), current[0]))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = model(ids)  # kept alive: its graph holds what backward needs
    for hook in hooks:
        hook.remove()
    seen, per_layer = set(), Counter()
    for ref, layer in saved:
        tensor = ref()
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            per_layer[layer] += storage.nbytes()
    del out
    return per_layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_block_keeps_what_the_model_counts(variant, dtype):
    family, overrides = VARIANTS[variant]
    config = hf_config(family, overrides)
    shape = LlamaShape.from_hf(config)
    torch.manual_seed(0)
    model = LlamaSequential(shape, TensorParallelGroup.single(), dtype=dtype)
    measured = kept_bytes_per_block(model, torch.randint(0, config.vocab_size, (B, S)))
    lp = 2 if dtype == torch.bfloat16 else 4
    fused = not shape.is_mla  # this CPU's kernel runs grouped-query attention fused, MLA's unequal widths unfused
    modelled = [activation_bytes_per_layer(shape, B, S, 1, flash_attention=fused, lp=lp, block=i)
                for i in range(shape.num_layers)]
    modelled[0] += shared_rope_bytes(shape, S, lp=lp)  # RoPE's tables: saved first by block 0, shared by all
    assert [measured[i + 1] for i in range(shape.num_layers)] == modelled  # layers[0] is the embedding
    if shape.is_moe:  # the blocks of both kinds differ, so a count of one kind for all would fail above
        assert len(set(modelled[1:])) == 1 + bool(set(shape.dense_layers) - {0})
    # the rank's total: every block by its kind, the embedding's ids and the loss's tensors (not run here) aside
    total = activation_bytes(shape, B, S, 1, 1, 0, 1, flash_attention=fused, lp=lp)
    ends = input_layer_activation_bytes(shape, B, S, 1) + output_layer_activation_bytes(shape, B, S, 1, lp=lp)
    assert total - ends == sum(modelled)


@pytest.mark.parametrize("kernel", ["loop", "grouped_mm"])
def test_each_expert_kernel_keeps_what_the_model_counts(kernel):
    """Mixtral's blocks (h 64, f_e 96: strides grouped_mm takes) in bf16 with each kernel of model/expert_kernels.py,
    to the byte: the grouped kernel keeps gate and up, the loop also silu(gate) and the down projection's input."""
    shape = dataclasses.replace(LlamaShape.from_hf(hf_config("mixtral", {})), expert_kernel=kernel)
    torch.manual_seed(0)
    model = LlamaSequential(shape, TensorParallelGroup.single(), dtype=torch.bfloat16)
    measured = kept_bytes_per_block(model, torch.randint(0, shape.vocab_size, (B, S)))
    modelled = [activation_bytes_per_layer(shape, B, S, 1, lp=2, block=i) for i in range(shape.num_layers)]
    modelled[0] += shared_rope_bytes(shape, S, lp=2)
    assert [measured[i + 1] for i in range(shape.num_layers)] == modelled


def test_moe_terms_scale_with_what_they_count():
    """The expert rows grow with k and f_e, the shared expert with its width, the router with E; a dense block
    of a MoE model counts its own intermediate_size."""
    def looped(overrides):  # the loop of GEMMs keeps 4 widths a row, the grouped kernel 2 (checked below)
        return dataclasses.replace(LlamaShape.from_hf(hf_config("qwen2_moe", overrides)), expert_kernel="loop")

    shape = looped({})
    moe, dense = (activation_bytes_per_layer(shape, B, S, 1, block=i) for i in (1, 0))
    n, h, k, f = B * S, shape.hidden_size, shape.experts_per_token, shape.expert_intermediate_size
    wider = looped(dict(moe_intermediate_size=f + 8))
    assert activation_bytes_per_layer(wider, B, S, 1, block=1) - moe == n * k * 2 * 4 * 8
    more = looped(dict(num_experts_per_tok=k + 1))
    assert activation_bytes_per_layer(more, B, S, 1, block=1) - moe == n * (20 + 2 * (3 * h + 4 * f)) + 12 * n
    aligned = looped(dict(moe_intermediate_size=48))
    grouped = dataclasses.replace(aligned, expert_kernel="grouped_mm")
    assert (activation_bytes_per_layer(aligned, B, S, 1, block=1) - activation_bytes_per_layer(grouped, B, S, 1, block=1)
            == n * k * 2 * 2 * 48)
    dense_wider = looped(dict(intermediate_size=shape.intermediate_size + 8))
    assert activation_bytes_per_layer(dense_wider, B, S, 1, block=0) - dense == 4 * 2 * n * 8
    assert activation_bytes_per_layer(dense_wider, B, S, 1, block=1) == moe
    # TP divides the expert and shared widths, not the rows' h
    halved = activation_bytes_per_layer(shape, B, S, 2, block=1)
    assert halved < moe and moe - halved > n * k * 2 * 4 * f / 2
