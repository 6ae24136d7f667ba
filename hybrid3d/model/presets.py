"""Published model shapes as `transformers` configs (LlamaConfig, or the family's class where an entry names a
`model_type`), for planning and for the training config's `hybrid3d.model.preset` key. Values are those of
the models' released `config.json` files.

`tiny` is a CPU demo model; its `vocab_size` is a placeholder that a tokenizer overrides.
"""

from transformers import AutoConfig, PretrainedConfig

from hybrid3d.errors import UserError


class UnknownPresetError(UserError, KeyError):
    """A preset name that is not in `PRESETS`; the message lists the known names."""

    def __str__(self):
        return self.args[0]


_LLAMA3_COMMON = dict(vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=128000,
                      eos_token_id=128001)

PRESETS = {
    "tiny": dict(vocab_size=4096, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                 tie_word_embeddings=False),
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "llama3-8b": dict(_LLAMA3_COMMON, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      tie_word_embeddings=False),
    "llama3.2-1b": dict(_LLAMA3_COMMON, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                        tie_word_embeddings=True,
                        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama3-70b": dict(_LLAMA3_COMMON, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
                       tie_word_embeddings=False),
    # q/k/v biases, 4 kv heads (Qwen/Qwen2.5-7B)
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       max_position_embeddings=131072,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
                       bos_token_id=151643, eos_token_id=151643),
    # q/k RMSNorm, head_dim 128 (Qwen/Qwen3-8B)
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     attention_bias=False, use_sliding_window=False, bos_token_id=151643, eos_token_id=151645),
    # 9 heads / 3 kv heads: TP 1, 3 or 9; tied embeddings (HuggingFaceTB/SmolLM2-135M-Instruct; hybrid3d.pretrained)
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2),
    # sliding window of 4096 (mistralai/Mistral-7B-v0.1)
    "mistral-7b-v0.1": dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                            max_position_embeddings=32768, rope_theta=10000.0, rms_norm_eps=1e-5, sliding_window=4096,
                            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    # Mixtures of experts. Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B: 128 experts, top-8 renormalised, every layer
    # sparse, q/k norms
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
                          max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
    "qwen3-235b-a22b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64,
                            num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                            router_aux_loss_coef=0.001, max_position_embeddings=40960, rope_theta=1000000.0,
                            rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
    # deepseek-ai/DeepSeek-V3: latent attention (q/kv latents 1536/512), 256 routed experts top-8 in 8 groups (4 kept),
    # one shared expert, 3 dense first layers, yarn x40 over 4096 positions; its multi-token-prediction layer is not
    # built (as transformers)
    "deepseek-v3": dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                        num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5,
                        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
                        n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True,
                        max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
                        rope_scaling={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                                      "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                      "original_max_position_embeddings": 4096},
                        bos_token_id=0, eos_token_id=1),
    # moonshotai/Moonlight-16B-A3B (DeepSeek-V3's architecture): no q latent, 64 experts top-6 in one group, 2 shared
    # experts, one dense first layer. Sizes as the public Megatron configs of this model give them (its config.json
    # itself was not readable here)
    "moonlight-16b-a3b": dict(model_type="deepseek_v3", vocab_size=163840, hidden_size=2048, intermediate_size=11264,
                              moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
                              num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
                              routed_scaling_factor=2.446, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                              v_head_dim=128, qk_nope_head_dim=128, n_group=1, topk_group=1, num_experts_per_tok=6,
                              first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=8192,
                              rope_theta=50000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
}


def preset_config(name: str) -> PretrainedConfig:
    """A fresh config for preset `name` (LlamaConfig unless it names a `model_type`); UnknownPresetError (a
    KeyError) lists the known names."""
    if name not in PRESETS:
        raise UnknownPresetError(f"unknown model preset {name!r} (known: {', '.join(PRESETS)})")
    fields = dict(PRESETS[name])
    return AutoConfig.for_model(fields.pop("model_type", "llama"), **fields)
