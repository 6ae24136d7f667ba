"""Published Llama shapes as `transformers.LlamaConfig`s, for planning and for the training config's
`hybrid3d.model.preset` key. Values are those of the models' released `config.json` files.

`tiny` is a CPU demo model; its `vocab_size` is a placeholder that a tokenizer overrides.
"""

from transformers import LlamaConfig

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
}


def preset_config(name: str) -> LlamaConfig:
    """A fresh `LlamaConfig` for preset `name`; UnknownPresetError (a KeyError) lists the known names."""
    if name not in PRESETS:
        raise UnknownPresetError(f"unknown model preset {name!r} (known: {', '.join(PRESETS)})")
    return LlamaConfig(**PRESETS[name])
