"""Layout and config validation: every refusal names the numbers or the field involved."""

import pytest
from transformers import LlamaConfig

from hybrid3d.errors import LayoutError, UnsupportedConfigError
from hybrid3d.model import LlamaShape
from hybrid3d.model.hf_weights import param_specs
from hybrid3d.parallel.layout import ParallelLayout
from tests.tiny_llama import BASE, CASES
from hybrid3d.model.tp_plan import check_split


def shape(**overrides):
    return LlamaShape.from_hf(LlamaConfig(**{**BASE, **CASES["gqa_llama3"], **overrides}))


def test_layout_derives_dp_and_names_itself():
    layout = ParallelLayout.for_world(8, tp=2, pp=2)
    assert (layout.tp, layout.pp, layout.dp, layout.world_size) == (2, 2, 2, 8)
    assert layout.name == "TP2-PP2-DP2"
    topo = layout.topology()
    # rank = pipe * d * t + data * t + model
    assert topo.get_rank(pipe=1, data=0, model=1) == 5
    assert topo.get_axis_names() == ["pipe", "data", "model"]


@pytest.mark.parametrize("world, tp, pp, needle", [
    (6, 4, 1, "world size 6 is not divisible by hybrid3d.tensor_parallel_size * hybrid3d.pipeline_parallel_size = 4 * 1 = 4"),
    (8, 3, 1, "= 3 * 1 = 3"),
    (4, 0, 1, "tensor_parallel_size (0)"),
])
def test_bad_world_is_refused(world, tp, pp, needle):
    with pytest.raises(LayoutError) as err:
        ParallelLayout.for_world(world, tp=tp, pp=pp)
    assert needle in str(err.value)


@pytest.mark.parametrize("layout, overrides, needle", [
    (ParallelLayout(3, 1, 1), {}, "num_attention_heads (4) is not divisible by tensor_parallel_size (3)"),
    (ParallelLayout(4, 1, 1), dict(num_attention_heads=12, num_key_value_heads=3, hidden_size=48),
     "num_key_value_heads (3) and tensor_parallel_size (4) must divide one another"),
    (ParallelLayout(2, 1, 1), dict(intermediate_size=63), "intermediate_size (63) is not divisible by"),
    (ParallelLayout(1, 3, 1), {}, "pipeline_parallel_size (3) exceeds num_hidden_layers (2)"),
])
def test_layout_that_cannot_split_the_model_is_refused(layout, overrides, needle):
    with pytest.raises(LayoutError) as err:
        check_split(shape(**overrides), layout.tp, layout.pp)
    assert needle in str(err.value)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_valid_layouts_pass(tp):
    check_split(shape(), tp, 2)


def test_kv_heads_split_or_replicated_in_the_weight_map():
    s = shape()  # 2 kv heads
    kinds = lambda tp: {p.kind for p in param_specs(s, tp) if "k_proj" in p.hf_name}
    assert kinds(2) == {"column"}
    assert kinds(4) == {"replicated"}


@pytest.mark.parametrize("overrides, needle", [
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}), "rope_type 'dynamic'"),
])
def test_unrepresentable_configs_are_refused(overrides, needle):
    with pytest.raises(UnsupportedConfigError) as err:
        shape(**overrides)
    assert needle in str(err.value)


def test_incomplete_llama3_rope_is_refused():
    config = LlamaConfig(**{**BASE, **CASES["gqa_llama3"]})
    config.rope_parameters = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0}  # edited by hand
    with pytest.raises(UnsupportedConfigError, match="lacks low_freq_factor, high_freq_factor"):
        LlamaShape.from_hf(config)


def test_config_fields_are_read():
    s = shape(rms_norm_eps=1e-6, max_position_embeddings=512)
    assert (s.num_heads, s.num_kv_heads, s.head_dim, s.rms_norm_eps, s.max_position_embeddings) == (4, 2, 8, 1e-6, 512)
    assert s.rope_type == "llama3" and s.rope_scaling["factor"] == 8.0
    tied = LlamaShape.from_hf(LlamaConfig(**{**BASE, **CASES["mha_tied"]}))
    assert tied.tie_word_embeddings and tied.rope_theta == 500000.0 and tied.rope_type == "default"
