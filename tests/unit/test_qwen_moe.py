"""Qwen3-MoE and Qwen2-MoE against Hugging Face `Qwen3MoeForCausalLM` / `Qwen2MoeForCausalLM`, fp32, one process
(TP 1): the softmax router, its top-k weights renormalised only with `norm_topk_prob`, experts of
`moe_intermediate_size`, dense blocks of `intermediate_size` where `mlp_only_layers` and `decoder_sparse_step` put
them, the load-balancing loss as HF adds it with `output_router_logits` (over the sparse layers only); Qwen3's q/k
norms; Qwen2-MoE's shared expert scaled by its sigmoid gate and its q/k/v biases; the checkpoint files' names both
ways.

The tiny models are odd in every size the families let be: 6 experts (not a power of two), top-3, experts 40 wide,
a dense MLP of 88, a shared expert of 56, head_dim 12.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from hybrid3d.errors import UnsupportedConfigError
from hybrid3d.model import LlamaSequential, LlamaShape, gather_vocab_logits, load_hf_state_dict
from hybrid3d.model.hf_source import HFSource
from hybrid3d.model.hf_weights import gather_hf_state_dict, unfuse_hf_experts
from hybrid3d.model.moe import load_balancing_loss
from hybrid3d.parallel.rank_groups import TensorParallelGroup
from tests.unit.test_moe_model import batch, max_diff, one_thread, ours_from  # noqa: F401 (one_thread: autouse)

# moe_intermediate_size differs from intermediate_size: the experts take the former, the dense blocks the latter.
# Layer 2 is dense (mlp_only_layers), the others mixtures of experts.
COMMON = dict(vocab_size=203, hidden_size=48, intermediate_size=88, moe_intermediate_size=40, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, num_experts=6, num_experts_per_tok=3,
              router_aux_loss_coef=0.02, max_position_embeddings=128, rms_norm_eps=1e-6, mlp_only_layers=[2])
FAMILIES = {"qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(COMMON, head_dim=12)),
            "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, dict(COMMON, shared_expert_intermediate_size=56))}
E = COMMON["num_experts"]
TP1 = TensorParallelGroup.single()
# Measured on the 2-core CPU VM (AMD EPYC, 2026-12-07), both families, with and without norm_topk_prob: logits within
# 1.2e-7 of HF's, losses equal, gradients within 9.0e-8; over 5 AdamW steps losses within 1.0e-7 relative, weights
# within 1.6e-6. The effects checked are far larger: the renormalisation moves the logits by >= 3.3e-3, the dense
# layer by >= 0.82, training the weights by >= 5.4e-3.
TOL, GRAD_TOL, LOSS_RTOL = 1e-5, 1e-6, 1e-6
ADAMW = dict(lr=1e-3, weight_decay=0.1, eps=1e-6)


def make_hf(family: str, seed: int = 0, **overrides):
    """A random tiny model of `family` with HF's eager expert loop; norms (q/k norms too), routers, q/k/v biases and
    the shared expert's gate made non-trivial."""
    config_class, model_class, sizes = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_class._from_config(config_class(**{**sizes, **overrides}), experts_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):  # decisive, not near-uniform
                p.normal_(0.0, 0.3)
            elif name.endswith("_proj.bias"):  # HF starts them at zero
                p.normal_(0.0, 0.1)
    return model


def hf_weights(hf) -> dict:
    return {n: t.detach() for n, t in unfuse_hf_experts(hf.state_dict(), hf.config.model_type).items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_shape_from_hf(family):
    config_class, _, sizes = FAMILIES[family]
    shape = LlamaShape.from_hf(config_class(**sizes, norm_topk_prob=True))
    assert (shape.num_experts, shape.experts_per_token, shape.expert_intermediate_size) == (6, 3, 40)
    assert shape.intermediate_size == 88 and shape.dense_layers == (2,) and shape.moe_layers == 3
    assert [shape.is_moe_layer(i) for i in range(4)] == [True, True, False, True]
    assert shape.router_renormalize and shape.model_type == family
    assert not LlamaShape.from_hf(config_class(**sizes)).router_renormalize  # the class default: False
    # HF's rule: layer i sparse iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    stepped = LlamaShape.from_hf(config_class(**{**sizes, "mlp_only_layers": [3], "decoder_sparse_step": 2}))
    assert stepped.dense_layers == (0, 2, 3) and stepped.moe_layers == 1
    if family == "qwen3_moe":
        assert shape.qk_norm and not shape.qkv_bias and not shape.shared_expert_intermediate_size
    else:
        assert shape.qkv_bias and not shape.qk_norm and shape.shared_expert_gate
        assert shape.shared_expert_intermediate_size == 56
        assert not LlamaShape.from_hf(config_class(**sizes, qkv_bias=False)).qkv_bias


@pytest.mark.parametrize("field, overrides", [
    ("decoder_sparse_step", dict(decoder_sparse_step=0)),
    ("mlp_only_layers", dict(mlp_only_layers=[4])),  # a layer the model lacks
    ("mlp_only_layers", dict(mlp_only_layers=[0, 1, 2, 3])),  # no sparse layer left
    ("shared_expert_intermediate_size", dict(shared_expert_intermediate_size=0)),
])
def test_what_hf_would_compute_differently_is_refused_naming_the_field(field, overrides):
    family = "qwen2_moe" if field.startswith("shared") else "qwen3_moe"
    config_class, _, sizes = FAMILIES[family]
    with pytest.raises(UnsupportedConfigError, match=field) as error:
        LlamaShape.from_hf(config_class(**{**sizes, **overrides}))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("family, overrides", [
    ("qwen3_moe", dict(norm_topk_prob=False)), ("qwen3_moe", dict(norm_topk_prob=True)),
    ("qwen2_moe", dict(norm_topk_prob=False)), ("qwen2_moe", dict(norm_topk_prob=True, decoder_sparse_step=2))])
def test_forward_and_gradients_match_hf(family, overrides):
    hf = make_hf(family, **overrides)
    model = ours_from(hf)
    ids, targets = batch()
    ref = hf(ids, labels=ids, output_router_logits=True)
    assert len(ref.router_logits) == model.shape.moe_layers  # HF's aux loss pools the sparse layers only, as ours
    logits, router_stats = model(ids)
    loss = model.loss_fn((logits, router_stats), targets)
    assert (gather_vocab_logits(logits, TP1, COMMON["vocab_size"]) - ref.logits).abs().max() <= TOL
    assert torch.allclose(load_balancing_loss(router_stats, E), ref.aux_loss, rtol=LOSS_RTOL, atol=0)
    assert torch.allclose(loss, ref.loss, rtol=LOSS_RTOL, atol=0)  # HF's loss: CE + coef · aux
    lm_only = F.cross_entropy(ref.logits.flatten(0, 1), targets.flatten())
    assert (ref.loss - lm_only).item() == pytest.approx(0.02 * ref.aux_loss.item(), rel=1e-4)
    ref.loss.backward()
    loss.backward()
    hf_grads = unfuse_hf_experts({n: p.grad for n, p in hf.named_parameters()}, family)
    ours = gather_hf_state_dict(model, model.shape, TP1, grads=True)
    assert max_diff(ours, hf_grads) <= GRAD_TOL
    if family == "qwen2_moe":  # the shared expert and its gate are trained through the gate's product
        assert min(ours[f"model.layers.3.mlp.{n}"].abs().max().item()
                   for n in ("shared_expert_gate.weight", "shared_expert.down_proj.weight")) > 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_what_each_family_adds_changes_the_output(family):
    """The same weights with a switch flipped give logits far apart, so each is read and used: the renormalisation,
    the dense layer, and Qwen2-MoE's shared-expert gate (the gate's weights zeroed: sigmoid 0.5 for every token)."""
    ids, _ = batch()
    base = ours_from(make_hf(family, norm_topk_prob=True))(ids)[0]
    assert (ours_from(make_hf(family, norm_topk_prob=False))(ids)[0] - base).abs().max() > 1e-3
    assert (ours_from(make_hf(family, norm_topk_prob=True, mlp_only_layers=[]))(ids)[0] - base).abs().max() > 1e-3
    if family == "qwen2_moe":
        hf = make_hf(family, norm_topk_prob=True)
        with torch.no_grad():
            for layer in hf.model.layers:
                if hasattr(layer.mlp, "shared_expert_gate"):
                    layer.mlp.shared_expert_gate.weight.zero_()
        assert (ours_from(hf)(ids)[0] - base).abs().max() > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_trains_like_hf_over_five_steps(family):
    hf = make_hf(family, seed=3, norm_topk_prob=True)
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
    assert max_diff(ours, hf_weights(hf)) <= TOL
    assert max_diff(ours, hf_weights(make_hf(family, seed=3, norm_topk_prob=True))) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_files_load_and_name_the_experts(tmp_path, family):
    """save_pretrained's files (one tensor per expert, the family's names) load into ours and give HF's logits; our
    gathered state dict carries exactly those names and values."""
    hf = make_hf(family, seed=5, norm_topk_prob=True)
    hf.save_pretrained(tmp_path)
    source = HFSource.open(str(tmp_path))
    assert "model.layers.0.mlp.experts.5.down_proj.weight" in source and "model.layers.1.mlp.gate.weight" in source
    assert "model.layers.2.mlp.gate_proj.weight" in source  # the dense layer
    shape = LlamaShape.from_hf(hf.config)
    model = LlamaSequential(shape, TP1)
    load_hf_state_dict(model, source, shape, TP1)
    ids, _ = batch(seed=6)
    assert (gather_vocab_logits(model(ids)[0], TP1, COMMON["vocab_size"]) - hf(ids).logits).abs().max() <= TOL
    ours = gather_hf_state_dict(model, shape, TP1)
    assert not shape.tie_word_embeddings and set(ours) == set(source)
    assert max_diff(ours, {n: source[n] for n in ours}) == 0.0


@pytest.mark.parametrize("family, tp, pp", [("qwen3_moe", 2, 1), ("qwen3_moe", 1, 2), ("qwen2_moe", 2, 2)])
def test_conversion_round_trip_is_bit_exact(tmp_path, family, tp, pp):
    """hf2hybrid at TP2 (each expert and the shared expert split like the dense MLP; the router, the gate and the
    q/k norms replicated) and/or PP2, then hybrid2hf: the same tensors under the same names, a config.json
    transformers loads as the family's class with no missing or unexpected key, and HF's logits."""
    import json

    from transformers import AutoModelForCausalLM

    from hybrid3d.convert.hf_to_hybrid import hf_to_hybrid
    from hybrid3d.convert.hybrid_to_hf import hybrid_to_hf

    hf = make_hf(family, seed=7, norm_topk_prob=True)
    source, checkpoint, exported = tmp_path / "hf", tmp_path / "hybrid", tmp_path / "out"
    hf.save_pretrained(source)
    hf_to_hybrid(source, checkpoint, tp=tp, pp=pp)
    hybrid_to_hf(checkpoint, exported)
    original, result = HFSource.open(str(source)), HFSource.open(str(exported))
    assert set(result) == set(original)
    assert all(torch.equal(result[name], original[name]) for name in original)
    config = json.loads((exported / "config.json").read_text())
    architecture = FAMILIES[family][1].__name__
    assert config["architectures"] == [architecture] and config["norm_topk_prob"] is True
    model, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True, dtype=torch.float32,
                                                       experts_implementation="eager")  # as `hf`'s
    assert type(model).__name__ == architecture
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids, _ = batch(seed=8)
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, hf.eval()(ids).logits)


def test_expert_parallelism_beside_a_stage_of_dense_layers_only_is_refused():
    """EP2 x PP2: a first stage holding dense layers only would leave DeepSpeed's ZeRO waiting forever (its
    gradient norm takes one model-parallel all-reduce per parameter group, and that stage has no expert group); a
    stage with one MoE layer is accepted."""
    from hybrid3d.config.validation import validate_run
    from hybrid3d.errors import LayoutError

    raw = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
           "hybrid3d": {"pipeline_parallel_size": 2, "expert_parallel_size": 2}}
    config_class, _, sizes = FAMILIES["qwen3_moe"]
    dense_first = LlamaShape.from_hf(config_class(**{**sizes, "mlp_only_layers": [0, 1]}))
    with pytest.raises(LayoutError, match=r"pipeline stage 0 holds only dense layers \[0, 1\]") as error:
        validate_run(raw, 4, dense_first, on_cpu=True)
    assert "\n" not in str(error.value)
    assert validate_run(raw, 4, LlamaShape.from_hf(config_class(**{**sizes, "mlp_only_layers": [0]})), on_cpu=True)
