"""The memory, step-time and planner models of the interleaved and DualPipeV schedules, against Narayanan et
al. 2021 (§2.2.2: interleaved bubble (p-1)/(v·m+p-1), rank 0 holding v·p + p - 1 chunks, 1 + (p-1)/(p·v)
times 1F1B's activations) and hand counts of where each stage lives. (The schedules' orders themselves:
test_pipeline_schedules.py; the measured bubbles and saved activations: benchmarks/pipeline_schedules.py.)"""

import dataclasses

import pytest

from hybrid3d.model import LlamaShape
from hybrid3d.model.presets import preset_config
from hybrid3d.planning.activations import activation_bytes_per_layer, input_layer_activation_bytes, rank_stages
from hybrid3d.planning.memory import activation_bytes, model_parameters, rank_parameter_numels
from hybrid3d.planning.planner import Cluster, estimate_step_time, format_plan, plan, schedule_options
from hybrid3d.planning.step_time import pipeline_slots

# h 64, a 4, kv 2, f 128, 8 layers, V 256: 8 layers split into 2·p chunks at p = 2 and p = 4.
EIGHT = LlamaShape(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=8, num_heads=4,
                   num_kv_heads=2, head_dim=16)
INTRA = 200e9  # Cluster's default intra-node bandwidth, bytes/s


@pytest.fixture(scope="module")
def llama2_7b():
    return LlamaShape.from_hf(preset_config("llama2-7b"))


def test_stage_placement():
    assert rank_stages("1f1b", 4, 1) == [1]
    assert rank_stages("interleaved", 4, 1, 2) == [1, 5]  # Megatron: chunk k of rank r is stage r + k·p
    assert rank_stages("dualpipev", 4, 1) == [1, 6]  # DeepSpeed's DualPipeVModule: stages r and 2p-1-r
    assert rank_stages("dualpipev", 4, 3) == [3, 4]


def test_interleaved_rank_0_holds_the_papers_extra_chunks():
    """p 2, v 2, m 4, chunks of 2 layers. Megatron's order on rank 0: 2(p-1) + (v-1)·p = 4 warm-up forwards
    (chunk 0 micro-batches 0, 1; chunk 1 micro-batches 0, 1), then forward/backward pairs: F(c0, 2) brings
    v·p + p - 1 = 5 chunks in flight; B(c1, 0), F(c0, 3) keeps 5, four of them chunk 0's (which also keeps
    the token ids a_in). 10 layers' worth = 1 + (p-1)/(p·v) = 1.25 times 1F1B's 8 (2 micro-batches x 4). RoPE's
    tables (4·s·d_h) are the rank's once, whatever is in flight."""
    b, s = 2, 32
    layer = activation_bytes_per_layer(EIGHT, b, s, 1)
    ids = input_layer_activation_bytes(EIGHT, b, s, 1)
    tables = 4 * s * EIGHT.head_dim
    one_f_one_b = activation_bytes(EIGHT, b, s, 1, 2, 0, gas=4) - tables
    assert one_f_one_b == pytest.approx(2 * (4 * layer + ids))
    interleaved = activation_bytes(EIGHT, b, s, 1, 2, 0, gas=4, schedule="interleaved", virtual=2) - tables
    assert interleaved == pytest.approx(5 * 2 * layer + 4 * ids)
    assert (interleaved - 4 * ids) / (one_f_one_b - 2 * ids) == pytest.approx(1 + (2 - 1) / (2 * 2))
    # With full checkpointing a block keeps its input 2·s·b·h, and one block is recomputed at a time.
    kept = 2 * s * b * EIGHT.hidden_size
    checkpointed = activation_bytes(EIGHT, b, s, 1, 2, 0, gas=4, checkpointing=True, schedule="interleaved", virtual=2)
    assert checkpointed == pytest.approx(5 * 2 * kept + 4 * ids + layer + tables)
    with pytest.raises(ValueError, match="virtual_pipeline_size"):  # 8 layers do not split into 3·2 chunks
        activation_bytes(EIGHT, b, s, 1, 2, 0, gas=4, schedule="interleaved", virtual=3)


def test_parameters_per_rank_follow_the_stages():
    """Interleaving moves blocks between ranks but not the embedding (rank 0) or the head (rank p-1);
    DualPipeV puts both on rank 0, where a tied embedding is one module."""
    untied = [sum(rank_parameter_numels(EIGHT, 1, 4, r)) for r in range(4)]
    interleaved = [sum(rank_parameter_numels(EIGHT, 1, 4, r, "interleaved", 2)) for r in range(4)]
    assert interleaved == untied  # each rank still holds 2 blocks; embedding on 0, norm and head on 3
    block = sum(rank_parameter_numels(EIGHT, 1, 4, 1))  # rank 1: two blocks
    embed = 256 * 64
    dualpipev = [sum(rank_parameter_numels(EIGHT, 1, 4, r, "dualpipev")) for r in range(4)]
    assert dualpipev == [embed + block + 64 + embed, block, block, block]
    tied = dataclasses.replace(EIGHT, tie_word_embeddings=True)
    assert sum(sum(rank_parameter_numels(tied, 1, 4, r, "dualpipev")) for r in range(4)) == model_parameters(tied)
    assert sum(sum(rank_parameter_numels(tied, 1, 4, r)) for r in range(4)) == model_parameters(tied) + embed


def test_interleaved_bubble_and_pipeline_traffic(llama2_7b):
    """p 4, v 2, m 16, t 1 on one node: the bubble is compute·(p-1)/(v·m); the step lasts m + (p-1)/v
    micro-batch slots, in each of which a middle rank (stages 1 and 5) exchanges an activation and its
    gradient with stages 0, 2, 4 and 6 on other ranks: 4 boundaries, whole messages."""
    cluster = Cluster(gpus=4, gpu_memory_gb=80)
    boundary = 2 * 4096 * 4096 * 2  # b·s·h bf16 each way
    one_f_one_b = estimate_step_time(llama2_7b, cluster, 1, 4, 1, 1, 1, 16, 4096)
    interleaved = estimate_step_time(llama2_7b, cluster, 1, 4, 1, 1, 1, 16, 4096, schedule="interleaved", virtual=2)
    assert interleaved.compute == one_f_one_b.compute
    assert interleaved.bubble == pytest.approx(interleaved.compute * 3 / (2 * 16))
    assert one_f_one_b.bubble == pytest.approx(one_f_one_b.compute * 3 / 16)
    assert pipeline_slots("interleaved", 4, 16, 2) == 16 + 3 / 2
    assert interleaved.pipe == pytest.approx((16 + 3 / 2) * 4 * boundary / INTRA)
    assert one_f_one_b.pipe == pytest.approx((16 + 3) * 2 * boundary / INTRA)  # two neighbours, t = 1


def test_dualpipev_pipeline_traffic(llama2_7b):
    """DualPipeV at p 4: rank 1 holds stages 1 and 6 (neighbours 0, 2, 5, 7 on ranks 0, 2, 2, 0: 4 boundaries);
    rank 3's turn-around from stage 3 to 4 stays on the rank. The step lasts m/(1 - f) slots."""
    cluster = Cluster(gpus=4, gpu_memory_gb=80)
    boundary = 2 * 4096 * 4096 * 2
    step = estimate_step_time(llama2_7b, cluster, 1, 4, 1, 1, 1, 16, 4096, schedule="dualpipev")
    slots = pipeline_slots("dualpipev", 4, 16)
    assert 16 < slots < 16 + 3  # a smaller bubble than 1F1B's at the same m
    assert step.pipe == pytest.approx(slots * 4 * boundary / INTRA)
    assert step.bubble == pytest.approx(step.compute * (slots - 16) / 16)


def test_planner_offers_each_schedule_where_the_config_accepts_it(llama2_7b):
    assert schedule_options(EIGHT, 2, 4, zero=1) == [("1f1b", 1), ("interleaved", 2), ("dualpipev", 1)]
    assert schedule_options(EIGHT, 2, 3, zero=1) == [("1f1b", 1)]  # m % p != 0, m < 2p
    assert schedule_options(EIGHT, 2, 4, zero=2) == [("1f1b", 1)]  # pipeline ZeRO-2 runs 1F1B only
    assert schedule_options(EIGHT, 1, 4, zero=1) == [("1f1b", 1)]
    assert schedule_options(EIGHT, 2, 4, zero=1, others=False) == [("1f1b", 1)]
    feasible, _ = plan(llama2_7b, Cluster(gpus=8, gpu_memory_gb=80), seq=4096, global_batch=64, schedules=True)
    by_layout = {}
    for c in feasible:
        by_layout.setdefault((c.tp, c.pp, c.dp, c.zero, c.sp, c.cp), {})[c.schedule] = c
    pairs = [rows for rows in by_layout.values() if {"1f1b", "interleaved"} <= rows.keys()]
    assert pairs
    for rows in pairs:  # at equal micro-batches the interleaved row has the smaller bubble
        a, b = rows["1f1b"], rows["interleaved"]
        if a.gas == b.gas:
            assert b.bubble < a.bubble
    assert {c.schedule for c in feasible} == {"1f1b", "interleaved", "dualpipev"}
    assert not any(c.schedule != "1f1b" and c.zero == 2 for c in feasible)
    table = format_plan(feasible, [], top=len(feasible))
    assert "int-v2" in table and "dpv" in table and "virtual_pipeline_size 2" in table
    plain, _ = plan(llama2_7b, Cluster(gpus=8, gpu_memory_gb=80), seq=4096, global_batch=64)
    assert {c.schedule for c in plain} == {"1f1b"}
