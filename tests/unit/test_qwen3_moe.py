"""Qwen3-MoE against Hugging Face `Qwen3MoeForCausalLM`, fp32, one process (TP 1): Qwen3's q/k norms with Mixtral's
feed-forward, the top-k weights renormalised only with `norm_topk_prob`, experts of `moe_intermediate_size`, the
load-balancing loss as HF adds it with `output_router_logits`; its checkpoint files' names both ways.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from hybrid3d.errors import UnsupportedConfigError
from hybrid3d.model import LlamaSequential, LlamaShape, gather_vocab_logits, load_hf_state_dict
from hybrid3d.model.hf_source import HFSource
from hybrid3d.model.hf_weights import gather_hf_state_dict, unfuse_hf_experts
from hybrid3d.model.moe import load_balancing_loss
from hybrid3d.parallel.rank_groups import TensorParallelGroup
from tests.unit.test_moe_model import batch, max_diff, one_thread, ours_from  # noqa: F401 (one_thread: autouse)

# moe_intermediate_size differs from intermediate_size: the experts must take the former
TINY = dict(vocab_size=203, hidden_size=64, intermediate_size=160, moe_intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
            router_aux_loss_coef=0.02, max_position_embeddings=128, rms_norm_eps=1e-6)
E, K = TINY["num_experts"], TINY["num_experts_per_tok"]
TP1 = TensorParallelGroup.single()
# Measured on the 2-core CPU VM (AMD EPYC, 2026-12-07): logits, loss and aux equal HF's bit for bit with and without
# norm_topk_prob; gradients differ by <= 9.7e-8; over 5 AdamW steps losses by <= 1.1e-7 relative, weights by
# <= 2.6e-6. The effects checked are far larger: the renormalisation moves the logits by 2.0e-2, training the
# weights by 5.5e-3.
TOL, GRAD_TOL, LOSS_RTOL = 1e-5, 1e-6, 1e-6
ADAMW = dict(lr=1e-3, weight_decay=0.1, eps=1e-6)


def make_hf(seed: int = 0, **overrides) -> Qwen3MoeForCausalLM:
    """A random tiny Qwen3-MoE with HF's eager expert loop; norms (q/k norms too) and routers made non-trivial."""
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**{**TINY, **overrides})
    model = Qwen3MoeForCausalLM._from_config(config, experts_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):  # decisive routing instead of near-uniform probabilities
                p.normal_(0.0, 0.3)
    return model


def test_shape_from_hf():
    shape = LlamaShape.from_hf(Qwen3MoeConfig(**TINY, norm_topk_prob=True))
    assert (shape.num_experts, shape.experts_per_token, shape.intermediate_size) == (4, 2, 48)
    assert shape.qk_norm and not shape.qkv_bias and shape.router_renormalize and shape.model_type == "qwen3_moe"
    assert not LlamaShape.from_hf(Qwen3MoeConfig(**TINY)).router_renormalize  # the class default: False


@pytest.mark.parametrize("field, overrides", [("mlp_only_layers", dict(mlp_only_layers=[0])),
                                               ("decoder_sparse_step", dict(decoder_sparse_step=2))])
def test_mixed_layers_are_refused_naming_the_field(field, overrides):
    with pytest.raises(UnsupportedConfigError, match=field) as error:
        LlamaShape.from_hf(Qwen3MoeConfig(**{**TINY, **overrides}))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_forward_and_gradients_match_hf(norm_topk_prob):
    hf = make_hf(norm_topk_prob=norm_topk_prob)
    model = ours_from(hf)
    ids, targets = batch()
    ref = hf(ids, labels=ids, output_router_logits=True)
    logits, router_stats = model(ids)
    loss = model.loss_fn((logits, router_stats), targets)
    assert (gather_vocab_logits(logits, TP1, TINY["vocab_size"]) - ref.logits).abs().max() <= TOL
    assert torch.allclose(load_balancing_loss(router_stats, E), ref.aux_loss, rtol=LOSS_RTOL, atol=0)
    assert torch.allclose(loss, ref.loss, rtol=LOSS_RTOL, atol=0)  # HF's loss: CE + coef · aux
    lm_only = F.cross_entropy(ref.logits.flatten(0, 1), targets.flatten())
    assert (ref.loss - lm_only).item() == pytest.approx(0.02 * ref.aux_loss.item(), rel=1e-4)
    ref.loss.backward()
    loss.backward()
    hf_grads = unfuse_hf_experts({n: p.grad for n, p in hf.named_parameters()}, "qwen3_moe")
    assert max_diff(gather_hf_state_dict(model, model.shape, TP1, grads=True), hf_grads) <= GRAD_TOL


def test_the_renormalisation_is_what_differs():
    """The same weights with and without norm_topk_prob give logits far apart (so the flag is read and used)."""
    ids, _ = batch()
    plain, renormalised = make_hf(norm_topk_prob=False), make_hf(norm_topk_prob=True)
    assert (ours_from(plain)(ids)[0] - ours_from(renormalised)(ids)[0]).abs().max() > 1e-3


def test_trains_like_hf_over_five_steps():
    hf = make_hf(seed=3, norm_topk_prob=True)
    model = ours_from(hf)
    ids, targets = batch(seed=4)
    opts = [torch.optim.AdamW(m.parameters(), **ADAMW) for m in (hf, model)]
    for _ in range(5):
        for opt in opts:
            opt.zero_grad()
        ref = hf(ids, labels=ids, output_router_logits=True).loss
        loss = model.loss(ids, targets)
        assert torch.allclose(loss, ref, rtol=LOSS_RTOL, atol=0)
        ref.backward()
        loss.backward()
        for opt in opts:
            opt.step()
    ours = gather_hf_state_dict(model, model.shape, TP1)
    assert max_diff(ours, {n: t.detach() for n, t in unfuse_hf_experts(hf.state_dict(), "qwen3_moe").items()}) <= TOL
    start = unfuse_hf_experts(make_hf(seed=3, norm_topk_prob=True).state_dict(), "qwen3_moe")
    assert max_diff(ours, {n: t.detach() for n, t in start.items()}) > 1e-3


def test_checkpoint_files_load_and_name_the_experts(tmp_path):
    """save_pretrained's files (one tensor per expert, Qwen3-MoE's names) load into ours and give HF's logits; our
    gathered state dict carries exactly those names and values."""
    hf = make_hf(seed=5, norm_topk_prob=True)
    hf.save_pretrained(tmp_path)
    source = HFSource.open(str(tmp_path))
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in source and "model.layers.1.mlp.gate.weight" in source
    shape = LlamaShape.from_hf(hf.config)
    model = LlamaSequential(shape, TP1)
    load_hf_state_dict(model, source, shape, TP1)
    ids, _ = batch(seed=6)
    assert (gather_vocab_logits(model(ids)[0], TP1, TINY["vocab_size"]) - hf(ids).logits).abs().max() <= TOL
    ours = gather_hf_state_dict(model, shape, TP1)
    assert not shape.tie_word_embeddings and set(ours) == set(source)
    assert max_diff(ours, {n: source[n] for n in ours}) == 0.0


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_conversion_round_trip_is_bit_exact(tmp_path, tp, pp):
    """hf2hybrid at TP2 (each expert split like the dense MLP, the router and q/k norms replicated) or PP2, then
    hybrid2hf: the same tensors under the same names, a config.json transformers loads as Qwen3MoeForCausalLM with
    no missing or unexpected key, and HF's logits."""
    import json

    from transformers import AutoModelForCausalLM

    from hybrid3d.convert.hf_to_hybrid import hf_to_hybrid
    from hybrid3d.convert.hybrid_to_hf import hybrid_to_hf

    hf = make_hf(seed=7, norm_topk_prob=True)
    source, checkpoint, exported = tmp_path / "hf", tmp_path / "hybrid", tmp_path / "out"
    hf.save_pretrained(source)
    hf_to_hybrid(source, checkpoint, tp=tp, pp=pp)
    hybrid_to_hf(checkpoint, exported)
    original, result = HFSource.open(str(source)), HFSource.open(str(exported))
    assert set(result) == set(original)
    assert all(torch.equal(result[name], original[name]) for name in original)
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["norm_topk_prob"] is True
    model, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids, _ = batch(seed=8)
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, hf.eval()(ids).logits)
