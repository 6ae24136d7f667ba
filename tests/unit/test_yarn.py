"""YaRN rope scaling (Peng et al. 2023) against Hugging Face, one process, fp32: the frequencies and the attention
factor HF's `_compute_yarn_parameters` gives, read from each family's config, in the one rotary module every family
uses. Logits equal HF's bit for bit for Llama with yarn's defaults and Qwen3 with every setting given (beta_fast,
beta_slow, mscale, mscale_all_dim, truncate false; attention_factor), Qwen3-MoE's within 1e-6; gradients and 3 AdamW
steps match; refusals name the field."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from hybrid3d.errors import UnsupportedConfigError
from hybrid3d.model import LlamaSequential, LlamaShape, gather_vocab_logits, load_hf_state_dict
from hybrid3d.model.hf_weights import gather_hf_state_dict, unfuse_hf_experts
from hybrid3d.parallel.rank_groups import TensorParallelGroup
from hybrid3d.parallel.tensor_parallel import IGNORE_INDEX

TP1 = TensorParallelGroup.single()
SIZES = dict(vocab_size=203, hidden_size=48, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=12, max_position_embeddings=128, tie_word_embeddings=False)
# A context of 16 extended 3x, and the sequences 40 long: past the original context, where yarn's pairs differ.
ALL_SETTINGS = dict(rope_type="yarn", factor=3.0, original_max_position_embeddings=16, beta_fast=8, beta_slow=2,
                    mscale=0.9, mscale_all_dim=0.7, truncate=False, rope_theta=1e4)
CASES = {
    "llama-defaults": (LlamaConfig, LlamaForCausalLM, dict(rope_type="yarn", factor=4.0,
                                                           original_max_position_embeddings=32, rope_theta=1e4)),
    "qwen3-all-settings": (Qwen3Config, Qwen3ForCausalLM, ALL_SETTINGS),
    "qwen3-attention-factor": (Qwen3Config, Qwen3ForCausalLM, dict(ALL_SETTINGS, attention_factor=1.3)),
    "qwen3moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(rope_type="yarn", factor=2.0,
                                                           original_max_position_embeddings=16, rope_theta=1e4)),
}
MOE = dict(moe_intermediate_size=40, num_experts=6, num_experts_per_tok=3, norm_topk_prob=True)


def make(case: str, rope: dict | None = None, seed: int = 0):
    config_class, model_class, yarn = CASES[case]
    sizes = dict(SIZES, **(MOE if config_class is Qwen3MoeConfig else {}))
    torch.manual_seed(seed)
    config = config_class(**sizes, rope_parameters=rope or yarn)
    moe = {"experts_implementation": "eager"} if config_class is Qwen3MoeConfig else {}  # HF's reference loop
    hf = model_class._from_config(config, **moe).float()
    shape = LlamaShape.from_hf(hf.config)
    ours = LlamaSequential(shape, TP1)
    load_hf_state_dict(ours, hf.state_dict(), shape, TP1)
    return hf, ours


def batch(seed: int = 1):
    ids = torch.randint(0, SIZES["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(seed))
    return ids, F.pad(ids[:, 1:], (0, 1), value=IGNORE_INDEX)


def logits_of(model, ids):
    out = model(ids)
    return gather_vocab_logits(out[0] if isinstance(out, tuple) else out, TP1, SIZES["vocab_size"])


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_hf_bit_for_bit_and_differ_from_plain_rope(case):
    hf, ours = make(case)
    ids, _ = batch()
    with torch.no_grad():
        ref = hf(ids).logits
        if "moe" in case:  # the expert sums round apart from HF's by 1.2e-7 with plain rope as with yarn (measured)
            assert (logits_of(ours, ids) - ref).abs().max() <= 1e-6
        else:
            assert torch.equal(logits_of(ours, ids), ref)
        plain, _ = make(case, rope={"rope_type": "default", "rope_theta": 1e4})
        assert (plain(ids).logits - ref).abs().max() > 1e-3  # yarn is what the models differ by


@pytest.mark.parametrize("case", ["qwen3-all-settings", "qwen3moe"])
def test_gradients_and_three_adamw_steps_match_hf(case):
    """Measured (2-core AMD EPYC VM, 2026-12-07): gradients within 3.0e-8, weights after 3 steps within 7.5e-7; the
    steps move the weights by 3.3e-3."""
    hf, ours = make(case, seed=2)
    ids, targets = batch(seed=3)
    kind = hf.config.model_type
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6) for m in (hf, ours)]
    for step in range(3):
        for opt in opts:
            opt.zero_grad()
        ref = hf(ids, labels=ids, **({"output_router_logits": True} if "moe" in kind else {})).loss  # + coef · aux
        loss = ours.loss(ids, targets)
        assert torch.allclose(loss, ref, rtol=1e-6, atol=0)
        ref.backward()
        loss.backward()
        if step == 0:
            hf_grads = unfuse_hf_experts({n: p.grad for n, p in hf.named_parameters()}, kind)
            ours_grads = gather_hf_state_dict(ours, ours.shape, TP1, grads=True)
            assert max((ours_grads[n] - hf_grads[n]).abs().max().item() for n in hf_grads) <= 1e-6
        for opt in opts:
            opt.step()
    final = gather_hf_state_dict(ours, ours.shape, TP1)
    ref = unfuse_hf_experts(hf.state_dict(), kind)
    assert max((final[n] - ref[n]).abs().max().item() for n in ref) <= 1e-5


@pytest.mark.parametrize("rope, field", [
    (dict(rope_type="yarn", factor=2.0, rope_theta=1e4), "original_max_position_embeddings"),
    (dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=16, partial_rotary_factor=0.5,
          rope_theta=1e4), "partial_rotary_factor"),
])
def test_what_the_rotary_module_cannot_compute_is_refused(rope, field):
    config = LlamaConfig(**SIZES)
    config.rope_parameters = rope  # set after construction: HF's own validation would fill or refuse it first
    with pytest.raises(UnsupportedConfigError, match=field) as error:
        LlamaShape.from_hf(config)
    assert "\n" not in str(error.value)
