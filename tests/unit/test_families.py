"""The per-family switches read from HF configs, what is refused, the sliding-window mask against HF's mask
function, the TP plan's new weights, and the memory model's parameter counts against the HF classes."""

import pytest
import torch
from transformers import AutoModelForCausalLM, GemmaConfig, MixtralConfig, Qwen2Config, Qwen3Config

from hybrid3d.errors import UnsupportedConfigError
from hybrid3d.model import LlamaShape
from hybrid3d.model.hf_weights import param_specs
from hybrid3d.model.masks import attention_bias, sliding_window_mask, sliding_window_mask_or_none
from hybrid3d.model.presets import PRESETS, preset_config
from hybrid3d.planning.memory import model_parameters, stage_parameter_numels
from tests.tiny_families import FAMILIES, family_config
from tests.tiny_llama import BASE


def test_switches_are_read_per_family():
    shapes = {family: LlamaShape.from_hf(family_config(family)) for family in FAMILIES}
    assert [(s.model_type, s.qkv_bias, s.qk_norm, s.sliding_window, s.head_dim, s.tie_word_embeddings)
            for s in shapes.values()] == [("qwen2", True, False, None, 8, True), ("qwen3", False, True, None, 16, False),
                                          ("mistral", False, False, 5, 8, False)]
    assert shapes["qwen3"].rope_theta == 1e6
    # Qwen2/Qwen3 window only with use_sliding_window, and then only the layers >= max_window_layers
    assert LlamaShape.from_hf(family_config("qwen2", sliding_window=7)).sliding_window is None
    every_layer = family_config("qwen3", use_sliding_window=True, sliding_window=7, max_window_layers=0)
    assert LlamaShape.from_hf(every_layer).sliding_window == 7
    assert LlamaShape.from_hf(family_config("mistral", sliding_window=None)).sliding_window is None


@pytest.mark.parametrize("config, needle", [
    (GemmaConfig(**BASE, num_attention_heads=4, num_key_value_heads=1, head_dim=8), "model_type 'gemma' is not supported"),
    (family_config("qwen2", use_sliding_window=True, sliding_window=7, max_window_layers=2),
     "layer_types mixes full_attention and sliding_attention"),
    (family_config("qwen3", attention_bias=True), "attention_bias=true is not supported"),
    (family_config("qwen2", hidden_act="gelu"), "hidden_act 'gelu'"),
    (family_config("mistral", rope_scaling={"rope_type": "dynamic", "factor": 4.0}), "rope_type 'dynamic'"),
    (family_config("mistral", sliding_window=0), "sliding_window must be >= 1"),
    (MixtralConfig(**BASE, num_attention_heads=4, num_local_experts=4, sliding_window=64), "sliding_window=64"),
])
def test_unsupported_fields_are_refused_in_one_line(config, needle):
    with pytest.raises(UnsupportedConfigError) as err:
        LlamaShape.from_hf(config)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_sliding_window_mask_matches_hf():
    from transformers.masking_utils import sliding_window_causal_mask_function

    hf = sliding_window_causal_mask_function(5)
    ours = sliding_window_mask(12, 5)
    t = torch.tensor
    assert ours.tolist() == [[bool(hf(t(0), t(0), t(i), t(j))) for j in range(12)] for i in range(12)]
    assert ours.sum(1).tolist() == [1, 2, 3, 4] + [5] * 8  # each query sees itself and at most 4 earlier keys
    assert sliding_window_mask_or_none(12, 12) is None and sliding_window_mask_or_none(12, None) is None
    one = attention_bias(12, 5, None, torch.float32, "cpu")  # additive, as SDPA makes of a boolean mask
    assert one is attention_bias(12, 5, None, torch.float32, "cpu")  # one tensor for all layers
    assert torch.equal(one == 0, ours) and attention_bias(12, 12, None, torch.float32, "cpu") is None


def test_tp_plan_places_biases_and_head_norms():
    qwen2, qwen3 = (LlamaShape.from_hf(family_config(f)) for f in ("qwen2", "qwen3"))
    kinds = lambda shape, tp: {s.hf_name.split("layers.0.")[1]: s.kind for s in param_specs(shape, tp)
                               if "layers.0.self_attn" in s.hf_name}
    assert {n: k for n, k in kinds(qwen2, 2).items() if n.endswith("bias")} == {
        "self_attn.q_proj.bias": "column", "self_attn.k_proj.bias": "column", "self_attn.v_proj.bias": "column"}
    # 2 kv heads at TP4: k/v weights and biases replicated, q still split
    assert {n: k for n, k in kinds(qwen2, 4).items() if n.endswith("bias")} == {
        "self_attn.q_proj.bias": "column", "self_attn.k_proj.bias": "replicated", "self_attn.v_proj.bias": "replicated"}
    assert kinds(qwen3, 2)["self_attn.q_norm.weight"] == kinds(qwen3, 2)["self_attn.k_norm.weight"] == "replicated"
    assert not any("bias" in n for n in kinds(qwen3, 2)) and not any("norm" in n for n in kinds(qwen2, 2))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_parameter_counts_match_the_hf_class(family):
    config = family_config(family)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    shape = LlamaShape.from_hf(config)
    assert model_parameters(shape) == sum(p.numel() for p in hf.parameters())
    # per TP rank: the TP model built on the meta device holds what the memory model says
    from hybrid3d.convert.model_layout import meta_model

    for tp in (1, 2, 4):
        model = meta_model(shape, tp - 1, tp)
        assert [p.numel() for p in model.parameters()] == stage_parameter_numels(shape, tp, 1, 0), (family, tp)


def test_published_family_presets():
    """Totals of the released checkpoints: Qwen2.5-7B 7.62B, Qwen3-8B 8.19B, Mistral-7B-v0.1 7.24B."""
    expected = {"qwen2.5-7b": (7.6156e9, "Qwen2Config"), "qwen3-8b": (8.1907e9, "Qwen3Config"),
                "mistral-7b-v0.1": (7.2417e9, "MistralConfig")}
    for name, (count, config_class) in expected.items():
        config = preset_config(name)
        assert type(config).__name__ == config_class
        assert model_parameters(LlamaShape.from_hf(config)) == pytest.approx(count, rel=1e-4), name
    assert LlamaShape.from_hf(preset_config("mistral-7b-v0.1")).sliding_window == 4096
    assert set(expected) <= set(PRESETS)


def test_universal_checkpoint_patterns_follow_the_plan():
    """ds_to_universal merges by name: Qwen3's q/k norms are replicated, Qwen2's biases concatenated like their
    weights (neither row-parallel nor vocabulary), replicated with k/v when tp > kv heads."""
    from deepspeed.checkpoint import constants as uc

    from hybrid3d.checkpoint.universal import universal_checkpoint_info

    def patterns(family, tp):
        info = universal_checkpoint_info(LlamaShape.from_hf(family_config(family)), tp)
        return {key: " ".join(info[key]) for key in (uc.TP_REPLICATED_PARAMETER_PATTERNS,
                                                      uc.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
                                                      uc.VOCABULARY_PARAMETER_PATTERNS)}

    qwen3 = patterns("qwen3", 2)
    assert r"^1\.self_attn\.q_norm\.weight$" in qwen3[uc.TP_REPLICATED_PARAMETER_PATTERNS]
    assert r"^4\.self_attn\.k_norm\.weight$" in qwen3[uc.TP_REPLICATED_PARAMETER_PATTERNS]
    split, replicated = patterns("qwen2", 2), patterns("qwen2", 4)
    assert "bias" not in " ".join(split.values())  # column-parallel: ds_to_universal's default, dim 0
    assert r"^1\.self_attn\.k_proj\.bias$" in replicated[uc.TP_REPLICATED_PARAMETER_PATTERNS]
    assert "q_proj" not in replicated[uc.TP_REPLICATED_PARAMETER_PATTERNS]
