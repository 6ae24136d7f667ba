"""The planner's step-time estimate (hybrid3d.planning.planner.estimate_step_time), its pipeline term:
(m + p - 1) x the slowest stage's send/recv + pipeline all-gather time per micro-batch."""

import pytest

from hybrid3d.model import LlamaShape
from hybrid3d.model.presets import preset_config
from hybrid3d.planning.planner import Cluster, estimate_step_time, plan

INTRA, INTER = 200e9, 25e9  # Cluster's default bandwidths, bytes/s


@pytest.fixture(scope="module")
def llama2_7b():
    return LlamaShape.from_hf(preset_config("llama2-7b"))  # h = 4096


def test_stage_boundaries_follow_the_rank_placement():
    # rank = stage·d·t + data·t + model, nodes of 8 consecutive ranks.
    cluster = Cluster(gpus=16, gpu_memory_gb=80, gpus_per_node=8)
    # t·d = 4: stage 0 (ranks 0-3) -> 1 (4-7) stays in node 0, 1 -> 2 (8-11) crosses, 2 -> 3 stays in node 1.
    assert [cluster.pipe_link_gbps(st, 2, 2) for st in range(3)] == [200.0, 25.0, 200.0]
    # t·d = 8 fills a node: every boundary crosses.
    assert [cluster.pipe_link_gbps(st, 2, 4) for st in range(1)] == [25.0]
    # t·d = 3: stage 1 (ranks 3-5) -> 2 (6-8): rank 5 -> 8 crosses, so the boundary is inter-node.
    assert [cluster.pipe_link_gbps(st, 1, 3) for st in range(2)] == [200.0, 25.0]


def test_pipeline_seconds_by_hand(llama2_7b):
    # t 2, p 4, d 2 on 2 nodes of 8; b 1, s 4096, m 8, bf16.
    # One message slice: b·s·h/t·2 = 4096·4096 = 16777216 bytes; a boundary moves 2 of them per
    # micro-batch (activation, gradient). Links: 0-1 intra, 1-2 inter, 2-3 intra (test above).
    # Slowest stage (1 or 2): one intra and one inter boundary + 3 all-gathers of a slice, each moving
    # (t - 1)·16777216 bytes inside the node.
    per_micro = 2 * 16777216 / INTRA + 2 * 16777216 / INTER + 3 * 16777216 / INTRA
    cluster = Cluster(gpus=16, gpu_memory_gb=80)
    step = estimate_step_time(llama2_7b, cluster, 2, 4, 2, 1, micro_batch=1, gas=8, seq=4096)
    assert step.pipe == pytest.approx((8 + 4 - 1) * per_micro)
    assert step.seconds == pytest.approx(step.compute + step.bubble + step.tp + step.dp + step.pipe + step.optimizer)
    assert step.bubble == pytest.approx(step.compute * (4 - 1) / 8)
    fp32 = estimate_step_time(llama2_7b, cluster, 2, 4, 2, 1, micro_batch=1, gas=8, seq=4096, precision="fp32")
    assert fp32.pipe == pytest.approx(2 * step.pipe)


def test_no_pipeline_no_pipeline_time(llama2_7b):
    cluster = Cluster(gpus=8, gpu_memory_gb=80)
    step = estimate_step_time(llama2_7b, cluster, 2, 1, 4, 1, micro_batch=1, gas=4, seq=4096)
    assert step.pipe == 0 and step.bubble == 0
    assert step.seconds == step.compute + step.tp + step.dp + step.optimizer


def test_the_optimizer_step_moves_28_bytes_a_parameter_in_fp32(llama2_7b):
    # Llama 2 7B has 6,738,415,616 parameters; fp32 Adam reads the weight, gradient and two moments and writes
    # three of them: 28 bytes each, at the H100's 3350 GB/s of HBM3. ZeRO-1 over d = 4 steps a quarter on a rank.
    whole = 6_738_415_616 * 28 / 3350e9
    cluster = Cluster(gpus=4, gpu_memory_gb=80)
    alone = estimate_step_time(llama2_7b, cluster, 1, 1, 1, 0, 1, 4, 4096, precision="fp32")
    assert alone.optimizer == pytest.approx(whole)
    sharded = estimate_step_time(llama2_7b, cluster, 1, 1, 4, 1, 1, 4, 4096, precision="fp32")
    assert sharded.optimizer == pytest.approx(whole / 4, rel=1e-6)
    assert sharded.optimizer < 0.01 * sharded.seconds  # about 1% of a GPU step here


def test_pipeline_time_grows_with_p(llama2_7b):
    # Fixed t 1, d 1, b 1, s 4096, m 16 on one node: a boundary moves 2·b·s·h·2 = 67108864 bytes per
    # micro-batch; the first and last stages have one boundary, the others two.
    boundary = 2 * 4096 * 4096 * 2
    one_node = Cluster(gpus=8, gpu_memory_gb=80)
    pipe = [estimate_step_time(llama2_7b, one_node, 1, p, 1, 1, 1, 16, 4096).pipe for p in (1, 2, 4, 8)]
    assert pipe == pytest.approx([0, 17 * boundary / INTRA, 19 * 2 * boundary / INTRA, 23 * 2 * boundary / INTRA])
    assert pipe == sorted(set(pipe))
    # Over nodes (t 1, d 4, nodes of 8): from p = 4 on, the middle stages have an inter-node boundary.
    nodes = Cluster(gpus=32, gpu_memory_gb=80)
    pipe = [estimate_step_time(llama2_7b, nodes, 1, p, 4, 1, 1, 16, 4096).pipe for p in (1, 2, 4, 8)]
    assert pipe == pytest.approx([0, 17 * boundary / INTRA, 19 * (boundary / INTRA + boundary / INTER),
                                  23 * (boundary / INTRA + boundary / INTER)])
    assert pipe == sorted(set(pipe))


def test_planner_ranks_by_the_same_estimate(llama2_7b):
    cluster = Cluster(gpus=8, gpu_memory_gb=80)
    feasible, _ = plan(llama2_7b, cluster, seq=4096, global_batch=512)
    for c in feasible:
        step = estimate_step_time(llama2_7b, cluster, c.tp, c.pp, c.dp, c.zero, c.micro_batch, c.gas, 4096,
                                  c.precision, c.checkpointing, offload=c.offload)
        assert (c.step_seconds, c.pipe_seconds) == (step.seconds, step.pipe)
        assert (c.pipe_seconds > 0) == (c.pp > 1)


def test_each_tp_message_adds_the_collectives_latency(llama2_7b):
    # t 2, one stage of 32 blocks, m 2: per micro-batch 2·32 + 1 (embedding) forward all-reduces, 2·32 + 1 (head
    # input) backward, 2 for the cross entropy: 132 messages, 264 a step; with SP 2·32·(2 + 4) + 1 + 2 all-gathers,
    # 32·(2 + 2) + 1 + 1 reduce-scatters, 2·32 + 1 norm all-reduces and 2 for the cross entropy: 195 + 130 + 65 + 2 =
    # 392, 784 a step.
    base, slow = Cluster(gpus=2, gpu_memory_gb=80), Cluster(gpus=2, gpu_memory_gb=80, latency_us=1000.0)
    for sp, messages in ((False, 264), (True, 784)):
        steps = [estimate_step_time(llama2_7b, c, 2, 1, 1, 1, 1, 2, 4096, sequence_parallel=sp) for c in (base, slow)]
        assert steps[1].tp - steps[0].tp == pytest.approx(messages * 1e-3)
        assert steps[1].compute == steps[0].compute and steps[1].dp == steps[0].dp


def test_each_pipeline_message_adds_the_latency(llama2_7b):
    # t 2, p 4, d 2 (as test_pipeline_seconds_by_hand): a middle stage sends and receives an activation and a
    # gradient at each of its 2 boundaries (4 messages) and runs 3 pipeline all-gathers a micro-batch: 7, over
    # m + p - 1 = 11 slots.
    base, slow = Cluster(gpus=16, gpu_memory_gb=80), Cluster(gpus=16, gpu_memory_gb=80, latency_us=1000.0)
    steps = [estimate_step_time(llama2_7b, c, 2, 4, 2, 1, micro_batch=1, gas=8, seq=4096) for c in (base, slow)]
    assert steps[1].pipe - steps[0].pipe == pytest.approx(11 * 7 * 1e-3)
