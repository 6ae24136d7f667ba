"""Tiny random Hugging Face Llamas written with `save_pretrained`, and HF reference results."""

from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

# Each case exercises a different part of the mapping; all have a vocabulary (203) that no
# tp * 128 divides, so every layout pads.
CASES = {
    # GQA (2 kv heads for 4 query heads) + llama3 rope scaling: with head_dim 8 and an original
    # context of 64 the four frequencies hit the unchanged, smoothed and scaled branches.
    "gqa_llama3": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # Multi-head attention with tied embedding / LM head (Llama 3.2 style) and a large rope theta.
    "mha_tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, rope_theta=500000.0),
    # One kv head: at tp 2 and 4 the kv heads are replicated over TP.
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False),
}

BASE = dict(vocab_size=203, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            max_position_embeddings=128, rms_norm_eps=1e-5)


def make_hf_llama(directory, case: str, seed: int = 0, **overrides) -> LlamaConfig:
    """Randomly initialise a tiny LlamaForCausalLM and `save_pretrained` it (safetensors)."""
    config = LlamaConfig(**{**BASE, **CASES[case], **overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # HF zero-initialises nothing of interest, but make norms non-trivial too
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    return config


def make_training_models(root) -> dict:
    """The two 4-layer models the training tests use: {"gqa": GQA + llama3 rope, "tied": tied MHA}."""
    model_dirs = {"gqa": str(Path(root) / "gqa"), "tied": str(Path(root) / "tied")}
    make_hf_llama(model_dirs["gqa"], "gqa_llama3", num_hidden_layers=4)
    make_hf_llama(model_dirs["tied"], "mha_tied", num_hidden_layers=4)
    return model_dirs


def load_hf(directory, dtype=torch.float32):
    """The HF class the folder's config names (LlamaForCausalLM, Qwen2ForCausalLM, ...), in eval mode."""
    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()


def token_batch(vocab_size: int, batch: int = 2, seq: int = 16, seed: int = 1):
    """(ids, targets): targets are ids shifted by one, the way packed pre-training samples are."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def hf_reference(directory, ids, targets, dtype=torch.float32) -> dict:
    """HF logits, loss and per-parameter gradients for one batch."""
    model = load_hf(directory, dtype)
    logits = model(ids).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    # HF's own shifted-label loss over the same tokens, as a check on our target convention.
    hf_loss = model(torch.cat([ids, targets[:, -1:]], dim=1), labels=torch.cat([ids, targets[:, -1:]], dim=1)).loss
    return {"logits": logits.detach(), "loss": loss.detach(), "hf_loss": hf_loss.detach(), "grads": grads}


def max_rel_error(actual, expected) -> float:
    """max |a - e| / max |e|: the error relative to the tensor's scale."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()
