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


# The presets against the HF class they configure and the model cards' totals and active counts (Qwen3 technical
# report Table 1 / the Qwen3 model cards: 30.5B and 3.3B, 235B and 22B; DeepSeek-V3 report §1: 671B and 37B; the
# Moonlight card: 16B and 3B, rounded). Active: the matmul parameters and the embedding table, as for Mixtral.
MOE_PRESETS = {"qwen3-30b-a3b": (30.5e9, 3.3e9, 3e-3, 3e-2), "qwen3-235b-a22b": (235e9, 22e9, 3e-3, 2e-2),
               "deepseek-v3": (671e9, 37e9, 1e-3, 2e-2), "moonlight-16b-a3b": (16e9, 3e9, 3e-3, 4e-2)}


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_moe_presets_are_the_published_models(name):
    import torch
    from transformers import AutoModelForCausalLM

    from hybrid3d.model.presets import preset_config

    total, active, total_rel, active_rel = MOE_PRESETS[name]
    config = preset_config(name)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    shape = LlamaShape.from_hf(config)
    assert model_parameters(shape) == sum(p.numel() for p in hf.parameters())
    assert model_parameters(shape) == pytest.approx(total, rel=total_rel)
    assert matmul_parameters(shape) + shape.vocab_size * shape.hidden_size == pytest.approx(active, rel=active_rel)


def _preset(name: str) -> LlamaShape:
    from hybrid3d.model.presets import preset_config

    return LlamaShape.from_hf(preset_config(name))


def test_expert_weights_are_divided_by_ep():
    """Qwen3-30B-A3B at TP1 x DP8, fp32 ZeRO-1: a rank holds the dense tensors and E/e experts a block, so its weights
    shrink by the routed experts' (e-1)/e; ZeRO still partitions its fp32 master and Adam's moments over all 8 ranks
    (the experts over the 8/e of their expert-data-parallel group), so those stay the same per rank."""
    from hybrid3d.planning.memory import rank_model_states
    from hybrid3d.planning.parameters import rank_expert_numels

    shape = _preset("qwen3-30b-a3b")
    experts = sum(rank_expert_numels(shape, 1, 1, 0))
    assert experts == 48 * 128 * 3 * 2048 * 768  # every layer's 128 experts of gate, up and down
    states = {e: rank_model_states(shape, 1, 1, 8, 1, "fp32", ep=e).boundary for e in (1, 2, 8)}
    total = model_parameters(shape)
    for e, s in states.items():
        assert s.params == pytest.approx(4 * (total - experts + experts / e), rel=1e-6), e
        assert s.master == pytest.approx(4 * total / 8, rel=1e-6), e
        assert s.optim_states == pytest.approx(8 * total / 8, rel=1e-6), e


def test_planner_answers_qwen3_30b_a3b_on_8_h100s():
    """8 x 80 GB, 4096 tokens, 64 sequences: rows that fit under the support table's layouts (each one checked by the
    rules a run applies: EP rows at ZeRO-1/2, no SP), the EP2 rows among them or refused for memory with
    their need; beyond the support table (the question issue 68 answers) EP8 fits."""
    from hybrid3d.planning.planner import plan
    from hybrid3d.planning.step_time import Cluster

    shape = _preset("qwen3-30b-a3b")
    rows, refused = plan(shape, Cluster(8, 80), 4096, 64, sequence_parallel=True, context_parallel=True,
                         schedules=True)
    assert rows and all(r.memory_gb <= 80 and not r.sp for r in rows)
    assert all(r.zero in (1, 2) and r.offload == "none" for r in rows if r.ep > 1)
    assert any(r.ep == 2 for r in rows) or any(" EP2 ZeRO-" in line and "needs >=" in line for line in refused)
    assert any("not a tested mixture-of-experts layout" in line for line in refused)
    untested, _ = plan(shape, Cluster(8, 80), 4096, 64, untested_experts=True)
    assert any(r.ep == 8 for r in untested)


def test_planner_answers_deepseek_v3_on_256_h100s():
    """671B parameters on 256 x 80 GB: none of the support table's layouts (t, pp, e <= 2) holds it, and the planner
    says so for each; with its layouts lifted it finds rows (the bf16 weights alone are 1.34 TB)."""
    from hybrid3d.planning.planner import plan
    from hybrid3d.planning.step_time import Cluster

    shape = _preset("deepseek-v3")
    rows, refused = plan(shape, Cluster(256, 80), 4096, 1024)
    assert rows == []
    assert any(line.startswith("TP2 PP2 DP64 ZeRO-1: needs >=") for line in refused)
    assert any(line.startswith("TP1 PP1 DP256 EP2 ZeRO-2: needs >=") for line in refused)


def test_an_ep_row_as_a_config():
    """--write-config of an fp32 EP row (a run's own precision): expert_parallel_size set, bf16 off."""
    from hybrid3d.config.auto_values import config_for_row
    from hybrid3d.planning.planner import Choice

    row = Choice(tp=2, pp=1, dp=4, zero=2, checkpointing=True, micro_batch=1, gas=8, states_gb=1, activations_gb=1,
                 memory_gb=2, step_seconds=1, bubble=0, pipe_seconds=0, run_precision="fp32", ep=2)
    config = config_for_row({"bf16": {"enabled": True}}, row, {"preset": "qwen3-30b-a3b"}, 4096, 64, {})
    assert config["hybrid3d"]["expert_parallel_size"] == 2 and config["hybrid3d"]["tensor_parallel_size"] == 2
    assert config["bf16"]["enabled"] is False and config["zero_optimization"]["stage"] == 2
