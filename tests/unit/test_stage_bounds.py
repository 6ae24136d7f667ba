"""Pipeline stage bounds (model/pipe.stage_bounds, the one owner): the layers' training FLOPs balanced with the LM
head counted (`partition_method: "cost"`, the default), or decoder blocks balanced by count (DeepSpeed's
`type:DecoderBlock`), checked by hand on Llama 3 8B and on a model whose head outweighs its blocks; the config refuses
other methods in one line, and a checkpoint records the method and bounds, so that a resume at its layout keeps its
stages unless the run sets another method, which goes through the universal checkpoint."""

import pytest
from transformers import LlamaConfig

from hybrid3d.checkpoint.files import write_meta
from hybrid3d.checkpoint.resume import plan_resume
from hybrid3d.checkpoint.schema import layout_record, recorded_schedule, saved_schedule
from hybrid3d.errors import ConfigError, LayoutError
from hybrid3d.model import LlamaShape
from hybrid3d.model.pipe import balanced_bounds, layer_costs, stage_bounds
from hybrid3d.model.presets import preset_config
from hybrid3d.planning.flops import training_flops_per_token
from hybrid3d.config.validation import validate_run
from tests.distributed.engine_runs import ds_config

LLAMA3_8B = LlamaShape.from_hf(preset_config("llama3-8b"))


def test_llama3_8b_costs_and_bounds_by_hand():
    """A block multiplies q, o (4096 x 4096 each), k, v (4096 x 1024) and the MLP (3 x 4096 x 14336): 218,103,808
    weights, 6x that per trained token; the head 128,256 x 4096, 6x: 2.41 blocks."""
    costs = layer_costs(LLAMA3_8B)
    block = 6 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert costs == (0,) + (block,) * 32 + (0, 6 * 128256 * 4096)
    # the costs add up to the 6N of the FLOPs per token (attention's scores aside)
    assert sum(costs) == training_flops_per_token(LLAMA3_8B, 1) - 12 * 32 * 32 * 128
    # count-balanced at PP4: 8 blocks a stage, the last with the head, 8 + 2.41 blocks of work
    assert stage_bounds(LLAMA3_8B, 4, "type:DecoderBlock") == (0, 9, 17, 25, 35)
    # cost-balanced: 8, 9, 9 and 6 blocks + the head (8.41): the costliest stage 9 blocks. No cut does better: the
    # stage with the head would need <= 6 blocks to stay under 9, leaving 26 blocks for three stages of <= 8.
    assert stage_bounds(LLAMA3_8B, 4, "cost") == (0, 9, 18, 27, 35) == stage_bounds(LLAMA3_8B, 4)  # the default
    assert stage_bounds(LLAMA3_8B, 2, "cost") == (0, 18, 35)  # 17 | 15 + 2.41 = 17.41
    with pytest.raises(ValueError, match="no modelled bounds"):
        stage_bounds(LLAMA3_8B, 4, "uniform")


def test_every_stage_keeps_a_decoder_block():
    """A 2-block model whose head costs 10 blocks: balancing cost alone would give the head a stage of its own;
    each stage keeps a block (the layer specs [embedding, block, block, norm, head])."""
    assert balanced_bounds((0, 1, 1, 0, 10), 2) == (0, 2, 5)
    assert balanced_bounds((0, 5, 1, 1, 0, 0), 3) == (0, 2, 3, 6)
    with pytest.raises(LayoutError, match="3 pipeline stages need as many decoder blocks; the model has 2"):
        balanced_bounds((0, 1, 1, 0, 10), 3)


def test_partition_method_is_checked_and_recorded():
    shape = LlamaShape.from_hf(LlamaConfig(vocab_size=203, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                           num_attention_heads=4, num_key_value_heads=2))
    raw = ds_config(1, 2, 1)
    raw["hybrid3d"]["partition_method"] = "flops"
    with pytest.raises(ConfigError) as caught:
        validate_run(raw, 2, shape)
    assert str(caught.value) == ("hybrid3d.partition_method must be one of type:DecoderBlock, cost, parameters, "
                                 "uniform, got 'flops'")
    # the record: the method with a pipeline (with its bounds; "cost" by default), "type:DecoderBlock" without, as
    # ever; an older record is read as block count, the default it was saved under
    record = layout_record(1, 2, stage_bounds=[0, 4, 7])
    assert (record["partition"], record["stage_bounds"]) == ("cost", [0, 4, 7])
    assert "stage_bounds" not in layout_record(2, 1, stage_bounds=[0, 7]) and layout_record(2, 1)["partition"] == \
        "type:DecoderBlock"
    older = {"tp": 1, "pp": 2, "dp": 1, "schedule": "1f1b", "virtual": 1}
    count = recorded_schedule(2, "1f1b", 1, "type:DecoderBlock")
    assert saved_schedule(older) == count != recorded_schedule(2, "1f1b", 1)


def saved_tag(tmp_path, name: str, layout: dict):
    tag = tmp_path / name
    tag.mkdir()
    write_meta(tag, {"layout": layout, "shape": {}, "module_only": False})
    return str(tag)


def test_resume_keeps_or_reshards_stages_cut_another_way(tmp_path):
    """A checkpoint cut by block count at the run's layout (the default before "cost"): kept, with no reshard, while
    partition_method is unset; resharded when the run sets another method; the same stages (the same method, or the
    same recorded bounds) load as they are; another layout reshards whatever the method."""
    count = layout_record(1, 2, partition="type:DecoderBlock", stage_bounds=[0, 3, 7])
    tag = saved_tag(tmp_path, "count", count)
    kept = plan_resume(tag, None, 1, 2, 1, {}, partition_set=False, bounds=(0, 4, 7))
    assert not kept.universal and kept.partition == "type:DecoderBlock"
    assert kept.why == ("they were cut by partition_method 'type:DecoderBlock' (layer-spec bounds [0, 3, 7]) at this "
                        "layout, so its files load as saved, without a reshard (hybrid3d.partition_method is unset; "
                        "set it to re-cut them through the universal checkpoint)")
    chosen = plan_resume(tag, None, 1, 2, 1, {}, partition="cost", partition_set=True, bounds=(0, 4, 7))
    assert chosen.universal and chosen.partition is None
    assert chosen.why == ("its stages were cut by partition_method 'type:DecoderBlock' (layer-spec bounds [0, 3, 7]), "
                          "hybrid3d.partition_method 'cost' cuts them [0, 4, 7]")
    same = plan_resume(tag, None, 1, 2, 1, {}, partition="type:DecoderBlock", bounds=(0, 3, 7))
    assert (same.universal, same.partition, same.why) == (False, None, "")
    assert not plan_resume(tag, None, 1, 2, 1, {}, partition="cost", bounds=(0, 3, 7)).universal  # the same bounds
    moved = plan_resume(tag, None, 1, 2, 2, {}, partition_set=False, bounds=(0, 4, 7))  # DP 1 -> 2
    assert moved.universal and (moved.partition, moved.why) == (None, "")
    # an older record (no method, no bounds): block count; without a pipeline nothing is cut
    older = saved_tag(tmp_path, "older", {"tp": 1, "pp": 2, "dp": 1})
    assert plan_resume(older, None, 1, 2, 1, {}, partition_set=False, bounds=(0, 4, 7)).partition == \
        "type:DecoderBlock"
    flat = saved_tag(tmp_path, "flat", layout_record(2, 1))
    assert plan_resume(flat, None, 2, 1, 1, {}, partition="uniform").why == ""
