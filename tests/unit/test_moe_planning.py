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


# The published config.json of Qwen3-30B-A3B and Qwen3-235B-A22B (Qwen/Qwen3-*), Qwen1.5-MoE-A2.7B and Qwen2-57B-A14B
# (Qwen/*): the sizes the parameter counts depend on, and the totals and active counts their model cards and the
# Qwen2 technical report (Table 1: 57.41B) give.
QWEN_MOE_CONFIGS = {
    "Qwen3-30B-A3B": ("qwen3_moe", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                                        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8),
                      30.5e9, 3.3e9),
    "Qwen3-235B-A22B": ("qwen3_moe", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                          moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64,
                                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8),
                        235e9, 22e9),
    "Qwen1.5-MoE-A2.7B": ("qwen2_moe", dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                                            moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                                            num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                                            num_experts=60, num_experts_per_tok=4), 14.3e9, 2.7e9),
    "Qwen2-57B-A14B": ("qwen2_moe", dict(vocab_size=151936, hidden_size=3584, intermediate_size=18944,
                                         moe_intermediate_size=2560, shared_expert_intermediate_size=20480,
                                         num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                         num_experts=64, num_experts_per_tok=8), 57.41e9, 14e9),
}


@pytest.mark.parametrize("name", QWEN_MOE_CONFIGS)
def test_qwen_moe_totals_and_active_parameters(name):
    """Every parameter HF's class builds for the published config (on the meta device), and the totals and active
    counts the model cards give (active: the matmul parameters plus the embedding table, as for Mixtral)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, sizes, total, active = QWEN_MOE_CONFIGS[name]
    config = AutoConfig.for_model(model_type, **sizes, tie_word_embeddings=False)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    shape = LlamaShape.from_hf(config)
    assert model_parameters(shape) == sum(p.numel() for p in hf.parameters())
    assert model_parameters(shape) == pytest.approx(total, rel=6e-3)
    assert matmul_parameters(shape) + sizes["vocab_size"] * sizes["hidden_size"] == pytest.approx(active, rel=3e-2)


def test_dense_and_moe_blocks_are_counted_and_weighed_apart():
    """A Qwen2-MoE shape with dense blocks 0 and 2 (decoder_sparse_step 2): each block's sizes are the built
    module's, in registration order (the shared expert and its gate after the routed experts), and pipeline stages
    are cut by each block's own cost."""
    from hybrid3d.model.llama import LlamaSequential
    from hybrid3d.model.pipe import layer_costs
    from hybrid3d.parallel.rank_groups import TensorParallelGroup

    shape = LlamaShape(vocab_size=203, hidden_size=48, intermediate_size=88, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=12, num_experts=6, experts_per_token=3, moe_intermediate_size=40,
                       dense_layers=(0, 2), shared_expert_intermediate_size=56, shared_expert_gate=True,
                       qkv_bias=True, model_type="qwen2_moe")
    model = LlamaSequential(shape, TensorParallelGroup.single(), seed=0)
    specs = layer_parameter_numels(shape, 1)
    for block in range(4):
        assert [p.numel() for p in getattr(model, str(block + 1)).parameters()] == specs[block + 1][1]
    attention = 4 * 12 * 48 * 2 + 2 * 12 * 48 * 2  # q, o, k, v
    dense, moe = attention + 3 * 48 * 88, attention + 3 * 3 * 48 * 40 + 6 * 48 + 3 * 48 * 56 + 48
    assert layer_costs(shape)[1:5] == (6 * dense, 6 * moe, 6 * dense, 6 * moe)
    assert sum(sum(sizes) for _, sizes in specs) == sum(p.numel() for p in model.parameters())


def test_deepseek_v3_totals_and_active_parameters():
    """DeepseekV3Config's defaults are DeepSeek-V3's published config.json sizes: every parameter HF builds (on the
    meta device; the multi-token-prediction layer, which HF does not build, left out), 671B in all and 37B active
    per token (DeepSeek-V3 report, arXiv 2412.19437, §1), latent attention and the shared expert included."""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    config = DeepseekV3Config()
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    shape = LlamaShape.from_hf(config)
    assert model_parameters(shape) == sum(p.numel() for p in hf.parameters())
    assert model_parameters(shape) == pytest.approx(671e9, rel=1e-3)
    assert matmul_parameters(shape) + config.vocab_size * config.hidden_size == pytest.approx(37e9, rel=2e-2)
