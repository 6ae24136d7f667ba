"""A tiny random Mixtral for the tests (the MoE twin of tiny_llama.py)."""

import torch
from transformers import MixtralConfig, MixtralForCausalLM

MIXTRAL = dict(vocab_size=203, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02,
               max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)


def make_mixtral(directory, seed: int = 0, **overrides) -> None:
    """A random tiny Mixtral with non-trivial norms and decisive routing, written with `save_pretrained`."""
    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**{**MIXTRAL, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(directory)


def load_mixtral(directory, **overrides) -> MixtralForCausalLM:
    return MixtralForCausalLM.from_pretrained(directory, dtype=torch.float32, experts_implementation="eager",
                                              **overrides).train()
