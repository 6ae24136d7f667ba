"""Parameters and FLOPs of mixture-of-experts models against Mixtral's paper (Jiang et al. 2024: 46.7B
parameters, 12.9B active per token for Mixtral 8x7B) and a hand count of the blocks hybrid3d builds."""

import pytest
from transformers import MixtralConfig

from hybrid3d.model import LlamaShape
from hybrid3d.planning.flops import matmul_parameters
from hybrid3d.planning.memory import layer_parameter_numels, model_parameters

# Mixtral 8x7B's published config.json (mistralai/Mixtral-8x7B-v0.1).
MIXTRAL_8X7B = MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                             max_position_embeddings=32768, sliding_window=None, rope_theta=1e6)


def test_mixtral_8x7b_totals_and_active_parameters():
    shape = LlamaShape.from_hf(MIXTRAL_8X7B)
    assert model_parameters(shape) == pytest.approx(46.7e9, rel=2e-3)
    # Active per token: the matmul parameters (the k = 2 routed experts, the router, attention and the head)
    # plus the embedding table, which the paper's 12.9B counts.
    assert matmul_parameters(shape) + 32000 * 4096 == pytest.approx(12.9e9, rel=2e-3)


def test_moe_block_parameters_per_rank():
    """h 64, f 96, 4 heads of 16, 2 kv heads, E 4: norms 2h, q and o h², k and v 2·32·h, router E·h, experts 3hf."""
    shape = LlamaShape(vocab_size=203, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, num_experts=4, experts_per_token=2)
    attention = 2 * 64 + 2 * 64 * 64 + 2 * 32 * 64
    block = dict(layer_parameter_numels(shape, 1))["DecoderBlock"]
    assert sum(block) == attention + 4 * 64 + 4 * 3 * 64 * 96
    assert sum(dict(layer_parameter_numels(shape, 1, ep=2))["DecoderBlock"]) == attention + 4 * 64 + 2 * 3 * 64 * 96
    tp2 = dict(layer_parameter_numels(shape, 2))["DecoderBlock"]  # experts split over TP, router replicated
    assert sum(tp2) == 2 * 64 + 2 * 32 * 64 + 2 * 16 * 64 + 4 * 64 + 4 * 3 * 64 * 48


def test_block_sizes_follow_the_model_registration_order():
    from hybrid3d.model.llama import LlamaSequential
    from hybrid3d.parallel.rank_groups import TensorParallelGroup

    shape = LlamaShape(vocab_size=203, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, num_experts=4, experts_per_token=2)
    model = LlamaSequential(shape, TensorParallelGroup.single(), seed=0)
    built = [p.numel() for p in getattr(model, "1").parameters()]
    assert built == dict(layer_parameter_numels(shape, 1))["DecoderBlock"]
