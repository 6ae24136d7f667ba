"""Tiny random mixture-of-experts models for the tests (the MoE twins of tiny_llama.py): Mixtral; Qwen3-MoE (Qwen3's
q/k norms, 6 experts of moe_intermediate_size, top-3 renormalised: norm_topk_prob; its first two layers dense, so
a two-stage pipeline's first stage holds no expert); Qwen2-MoE (the same router, a shared expert scaled by its
sigmoid gate, q/k/v biases; every other layer dense: decoder_sparse_step 2); DeepSeek-V3 (latent attention, the
sigmoid group-limited router with its score correction bias, ungated shared experts, a dense first layer)."""

import torch
from transformers import (AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM, MixtralConfig,
                          MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

MIXTRAL = dict(vocab_size=203, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02,
               max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)
# the same sizes as MIXTRAL where the families share them; the experts 48 wide, the dense MLP 160
QWEN3_MOE = dict(vocab_size=203, hidden_size=64, intermediate_size=160, moe_intermediate_size=48, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=3,
                 norm_topk_prob=True, router_aux_loss_coef=0.02, max_position_embeddings=128, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, mlp_only_layers=[0, 1])
QWEN2_MOE = dict({k: v for k, v in QWEN3_MOE.items() if k not in ("head_dim", "mlp_only_layers")},
                 shared_expert_intermediate_size=80, decoder_sparse_step=2, qkv_bias=True)
# DeepSeek-V3: latent attention (q/kv latents 24/20, heads of 12 + 8 and 10), 6 experts in 3 groups (2 kept), top-3,
# 2 shared experts, the first layer dense, the routers' score correction biases drawn non-zero
DEEPSEEK_V3 = dict(vocab_size=203, hidden_size=64, intermediate_size=160, moe_intermediate_size=48, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=12,
                   qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=6, num_experts_per_tok=3, n_group=3,
                   topk_group=2, n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                   norm_topk_prob=True, rope_interleave=True, max_position_embeddings=128, rms_norm_eps=1e-5,
                   tie_word_embeddings=False)
MOE_FAMILIES = {"mixtral": (MixtralConfig, MixtralForCausalLM, MIXTRAL),
                "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM, DEEPSEEK_V3),
                "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, QWEN2_MOE),
                "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, QWEN3_MOE)}


def make_mixtral(directory, seed: int = 0, family: str = "mixtral", **overrides) -> None:
    """A random tiny MoE model of `family` (MOE_FAMILIES) with non-trivial norms (q/k norms too), q/k/v biases and
    shared-expert gates, and decisive routing, written with `save_pretrained`."""
    config_class, model_class, sizes = MOE_FAMILIES[family]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**sizes, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0.0, 0.3)
            elif name.endswith("_proj.bias"):  # HF starts them at zero
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # HF starts them at zero
                b.uniform_(-0.2, 0.2)
    model.save_pretrained(directory)


def load_mixtral(directory, **overrides):
    """The model `make_mixtral` wrote (either family), with HF's eager expert loop, in training mode."""
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, experts_implementation="eager",
                                                **overrides).train()
