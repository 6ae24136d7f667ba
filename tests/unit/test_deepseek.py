"""DeepSeek-V3 against Hugging Face `DeepseekV3ForCausalLM`, fp32, one process (TP 1): multi-head latent attention
(with and without q_lora_rank, rope_interleave on and off, yarn with mscale_all_dim), the sigmoid router choosing on
scores + e_score_correction_bias among the best topk_group of n_group groups, its weights normalised and scaled by
routed_scaling_factor, the ungated shared experts, the first first_k_dense_replace layers dense; the checkpoint files'
names both ways (the router's bias a buffer, the shared experts `mlp.shared_experts.*`).

The tiny model is odd in every size the architecture lets be: 6 experts in 3 groups, top-3, experts 20 wide, 2 shared
experts (one SwiGLU of 40), a dense MLP of 88, q/kv latents of 24 and 20, heads of 12 + 8 (query/key) and 10 (value).
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from hybrid3d.errors import UnsupportedConfigError
from hybrid3d.model import LlamaSequential, LlamaShape, gather_vocab_logits, load_hf_state_dict
from hybrid3d.model.hf_source import HFSource
from hybrid3d.model.hf_weights import gather_hf_state_dict, unfuse_hf_experts
from hybrid3d.parallel.rank_groups import TensorParallelGroup
from hybrid3d.parallel.tensor_parallel import IGNORE_INDEX

TP1 = TensorParallelGroup.single()
SIZES = dict(vocab_size=203, hidden_size=48, intermediate_size=88, moe_intermediate_size=20, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=12,
             qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=6, num_experts_per_tok=3, n_group=3, topk_group=2,
             n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
             rope_interleave=True, max_position_embeddings=128, tie_word_embeddings=False,
             rms_norm_eps=1e-5)  # not the latent norms' epsilon, which HF fixes at 1e-6
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=0.8,
            rope_theta=1e4)
VARIANTS = {"base": {}, "no-q-lora": dict(q_lora_rank=None), "one-group": dict(n_group=1, topk_group=1),
            "halves": dict(rope_interleave=False), "yarn": dict(rope_parameters=YARN),
            "two-dense": dict(first_k_dense_replace=2, norm_topk_prob=False)}
# Measured on the 2-core CPU VM (AMD EPYC, 2026-12-07): logits within 1.5e-7 of HF's in every variant.
TOL, GRAD_TOL = 1e-5, 1e-6


def make_hf(seed: int = 0, **overrides) -> DeepseekV3ForCausalLM:
    """A random tiny DeepSeek-V3 with HF's eager expert loop; norms, routers and the routers' score correction
    biases (zero at HF's init) made non-trivial."""
    torch.manual_seed(seed)
    hf = DeepseekV3ForCausalLM._from_config(DeepseekV3Config(**{**SIZES, **overrides}), experts_implementation="eager")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.2, 0.2)
    return hf.float().train()


def ours_from(hf) -> LlamaSequential:
    shape = LlamaShape.from_hf(hf.config)
    model = LlamaSequential(shape, TP1)
    load_hf_state_dict(model, hf.state_dict(), shape, TP1)
    return model


def batch(seed: int = 1, s: int = 40):
    ids = torch.randint(0, SIZES["vocab_size"], (2, s), generator=torch.Generator().manual_seed(seed))
    return ids, F.pad(ids[:, 1:], (0, 1), value=IGNORE_INDEX)


def logits(model, ids):
    return gather_vocab_logits(model(ids)[0], TP1, SIZES["vocab_size"])


def max_diff(ours: dict, ref: dict) -> float:
    assert ours.keys() == ref.keys()
    return max((ours[n] - ref[n]).abs().max().item() for n in ref)


def hf_tensors(hf, grads: bool = False) -> dict:
    named = {n: (p.grad if grads else p.detach()) for n, p in hf.named_parameters()}
    if not grads:
        named.update({n: b for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")})
    return unfuse_hf_experts(named, "deepseek_v3")


def test_shape_from_hf():
    shape = LlamaShape.from_hf(DeepseekV3Config(**SIZES))
    assert shape.is_mla and (shape.q_lora_rank, shape.kv_lora_rank) == (24, 20)
    assert (shape.qk_nope_head_dim, shape.head_dim, shape.v_head_dim, shape.qk_head_dim) == (12, 8, 10, 20)
    assert (shape.num_experts, shape.experts_per_token, shape.expert_intermediate_size) == (6, 3, 20)
    assert (shape.router_groups, shape.router_topk_groups, shape.routed_scaling_factor) == (3, 2, 2.5)
    assert shape.router_scoring == "sigmoid" and shape.router_score_bias and shape.router_aux_loss_coef == 0.0
    assert shape.shared_expert_intermediate_size == 40 and not shape.shared_expert_gate
    assert shape.dense_layers == (0,) and shape.rope_interleave


@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_and_gradients_match_hf(variant):
    hf = make_hf(**VARIANTS[variant])
    model = ours_from(hf)
    ids, targets = batch()
    ref = hf(ids, labels=ids)
    out, router_stats = model(ids)
    assert (gather_vocab_logits(out, TP1, SIZES["vocab_size"]) - ref.logits).abs().max() <= TOL
    loss = model.loss_fn((out, router_stats), targets)  # no load-balancing term: HF's class adds none
    assert torch.allclose(loss, ref.loss, rtol=1e-6, atol=0)
    ref.loss.backward()
    loss.backward()
    assert max_diff(gather_hf_state_dict(model, model.shape, TP1, grads=True), hf_tensors(hf, grads=True)) <= GRAD_TOL


def test_what_each_part_adds_changes_the_output():
    """The score correction bias, the group limit, the scaling factor, the shared experts' width and the dense first
    layer each move the logits far beyond the tolerance, so each is read and used."""
    ids, _ = batch()
    with torch.no_grad():
        base = logits(ours_from(make_hf()), ids)
        unbiased = make_hf()
        for name, b in unbiased.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
        for model in (unbiased, make_hf(topk_group=3), make_hf(routed_scaling_factor=1.0), make_hf(n_shared_experts=1),
                      make_hf(first_k_dense_replace=0)):
            assert (logits(ours_from(model), ids) - base).abs().max() > 1e-3


def test_trains_like_hf_over_five_steps():
    """The router's bias is a buffer: training leaves it where it was, on both sides."""
    hf = make_hf(seed=3)
    model = ours_from(hf)
    ids, targets = batch(seed=4)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6) for m in (hf, model)]
    for _ in range(5):
        for opt in opts:
            opt.zero_grad()
        ref = hf(ids, labels=ids).loss
        loss = model.loss(ids, targets)
        assert torch.allclose(loss, ref, rtol=1e-6, atol=0)
        ref.backward()
        loss.backward()
        for opt in opts:
            opt.step()
    ours = gather_hf_state_dict(model, model.shape, TP1)
    assert max_diff(ours, hf_tensors(hf)) <= TOL
    start = hf_tensors(make_hf(seed=3))
    assert max_diff(ours, start) > 1e-3
    biases = [n for n in ours if n.endswith("e_score_correction_bias")]
    assert len(biases) == 3 and all(torch.equal(ours[n], start[n]) for n in biases)


def test_checkpoint_files_load_and_name_every_tensor(tmp_path):
    """save_pretrained's files load into ours and give HF's logits; our gathered state dict carries exactly the files'
    names and values: the router's weight and bias, each expert, the shared experts, MLA's projections and norms."""
    hf = make_hf(seed=5)
    hf.save_pretrained(tmp_path)
    source = HFSource.open(str(tmp_path))
    for name in ("model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.experts.5.down_proj.weight",
                 "model.layers.1.mlp.shared_experts.up_proj.weight", "model.layers.0.mlp.gate_proj.weight",
                 "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.2.self_attn.q_a_layernorm.weight"):
        assert name in source
    shape = LlamaShape.from_hf(hf.config)
    model = LlamaSequential(shape, TP1)
    load_hf_state_dict(model, source, shape, TP1)
    ids, _ = batch(seed=6)
    assert (logits(model, ids) - hf(ids).logits).abs().max() <= TOL
    ours = gather_hf_state_dict(model, shape, TP1)
    assert set(ours) == set(source)
    assert max_diff(ours, {n: source[n] for n in ours}) == 0.0


@pytest.mark.parametrize("variant, tp, pp", [("base", 2, 1), ("no-q-lora", 2, 2), ("two-dense", 1, 2)])
def test_conversion_round_trip_is_bit_exact(tmp_path, variant, tp, pp):
    """hf2hybrid at TP2 (q_b/q, kv_b and the experts split by heads and rows; the latent down projections, their
    norms, the router and its bias replicated) and/or PP2, then hybrid2hf: the same tensors under the same names, a
    config.json transformers loads as DeepseekV3ForCausalLM with no missing or unexpected key, and HF's logits."""
    import json

    from transformers import AutoModelForCausalLM

    from hybrid3d.convert.hf_to_hybrid import hf_to_hybrid
    from hybrid3d.convert.hybrid_to_hf import hybrid_to_hf

    hf = make_hf(seed=7, **VARIANTS[variant])
    source, checkpoint, exported = tmp_path / "hf", tmp_path / "hybrid", tmp_path / "out"
    hf.save_pretrained(source)
    hf_to_hybrid(source, checkpoint, tp=tp, pp=pp)
    hybrid_to_hf(checkpoint, exported)
    original, result = HFSource.open(str(source)), HFSource.open(str(exported))
    assert set(result) == set(original)
    assert all(torch.equal(result[name], original[name]) for name in original)
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
    model, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True, dtype=torch.float32,
                                                       experts_implementation="eager")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids, _ = batch(seed=8)
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, hf.eval()(ids).logits)


@pytest.mark.parametrize("field, overrides", [
    ("num_key_value_heads", dict(num_key_value_heads=2)),
    ("first_k_dense_replace", dict(first_k_dense_replace=4)),
    ("n_group", dict(n_group=4)),  # 6 experts do not split into 4 groups
    ("topk_group", dict(n_group=3, topk_group=1)),  # one group of 2 cannot hold top-3
])
def test_what_hf_would_compute_differently_is_refused_naming_the_field(field, overrides):
    with pytest.raises(UnsupportedConfigError, match=field) as error:
        LlamaShape.from_hf(DeepseekV3Config(**{**SIZES, **overrides}))
    assert "\n" not in str(error.value)


def test_multi_token_prediction_layers_are_skipped_saying_so(tmp_path, capsys):
    """A hub checkpoint's layer num_hidden_layers (multi-token prediction) is not the causal LM's: hf2hybrid leaves its
    tensors out with one line saying so, the export and its logits are the model's without them; a tensor of any
    other unknown layer is still refused."""
    from safetensors.torch import load_file, save_file

    from hybrid3d.convert.__main__ import main
    from hybrid3d.convert.hybrid_to_hf import hybrid_to_hf

    hf = make_hf(seed=9)
    source = tmp_path / "hf"
    hf.save_pretrained(source)
    tensors = load_file(source / "model.safetensors")
    mtp = {"model.layers.4.eh_proj.weight": torch.ones(48, 96), "model.layers.4.enorm.weight": torch.ones(48)}
    save_file({**tensors, **mtp}, source / "model.safetensors", metadata={"format": "pt"})
    assert main(["hf2hybrid", "--hf-model", str(source), "--out", str(tmp_path / "ckpt"), "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "skipped layer 4 (2 tensors): DeepSeek-V3's multi-token prediction" in out
    hybrid_to_hf(tmp_path / "ckpt", tmp_path / "out")
    exported = HFSource.open(str(tmp_path / "out"))
    assert set(exported) == set(tensors) and all(torch.equal(exported[n], tensors[n]) for n in tensors)
    save_file({**tensors, "model.layers.5.enorm.weight": torch.ones(48)}, source / "model.safetensors",
              metadata={"format": "pt"})
    assert main(["hf2hybrid", "--hf-model", str(source), "--out", str(tmp_path / "ckpt2"), "--tp", "1"]) == 2
    assert "model.layers.5.enorm.weight' has no place in the model" in capsys.readouterr().err
