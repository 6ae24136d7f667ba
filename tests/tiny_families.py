"""Tiny random Hugging Face Qwen2, Qwen3 and Mistral models written with `save_pretrained`.

Each exercises what its family adds to the Llama decoder, with values that make the addition matter:
- qwen2: q/k/v biases drawn away from zero, tied embeddings, 2 kv heads (split at TP2, replicated at TP4);
- qwen3: q/k RMSNorm weights drawn away from one, head_dim 16 != hidden 32 / 4 heads, untied, rope theta 1e6;
- mistral: a sliding window of 5 positions (shorter than the tests' 16-token sequences), one kv head
  (replicated over TP), untied.
All have the vocabulary (203) of tests/tiny_llama.py, which no tp * 128 divides.
"""

import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config, Qwen3Config

from tests.tiny_llama import BASE

FAMILIES = {
    "qwen2": (Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                                rope_theta=1e6)),
    "mistral": (MistralConfig, dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=5,
                                    tie_word_embeddings=False)),
}
HF_CLASSES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}


def family_config(family: str, **overrides):
    config_class, fields = FAMILIES[family]
    return config_class(**{**BASE, "num_hidden_layers": 4, **fields, **overrides})


def make_hf_family(directory, family: str, seed: int = 0, **overrides):
    """Randomly initialise a tiny model of `family` with non-trivial norms and biases; `save_pretrained` it."""
    config = family_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # layer norms, the final norm, Qwen3's q_norm / k_norm
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):  # HF initialises Qwen2's biases to zero, which would test nothing
                p.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    return config


def make_family_models(root) -> dict:
    """{family: folder} of the three tiny models."""
    dirs = {family: str(root / family) for family in FAMILIES}
    for family, directory in dirs.items():
        make_hf_family(directory, family)
    return dirs
