"""Pipeline traffic of DeepSpeed's PipelineEngine (1F1B TrainSchedule): send/recv bytes at stage
boundaries and the TP all-gathers that re-assemble partitioned messages (hybrid3d.planning.traffic)."""

import pytest

from hybrid3d.model import LlamaShape
from hybrid3d.planning.traffic import pp_bytes_per_step, pp_gather_bytes_per_step

# zero_compare's "S" Llama: h = 128.
S = LlamaShape(vocab_size=4096, hidden_size=128, intermediate_size=352, num_layers=4, num_heads=4, num_kv_heads=2,
               head_dim=32)


def test_pipeline_bytes_by_hand():
    # b = 2, s = 128, h = 128, bf16 (2 bytes), t = 2, p = 4, m = 4.
    # One partitioned message: b·s·h/t·2 = 2·128·128/2·2 = 32768 bytes; a boundary moves the activation
    # and its gradient: 2·32768 = 65536 bytes per micro-batch.
    b, s, t, p, m = 2, 128, 2, 4, 4
    send_recv = [pp_bytes_per_step(S, b, s, t, p, stage, m) for stage in range(p)]
    assert send_recv == [4 * 1 * 65536, 4 * 2 * 65536, 4 * 2 * 65536, 4 * 1 * 65536]  # m · boundaries · 65536
    # all-gathers of one 32768-byte slice: first stage its output + the gradient (2), middle stages
    # also their input (3), last stage its input (1).
    gathers = [pp_gather_bytes_per_step(S, b, s, t, p, stage, m) for stage in range(p)]
    assert gathers == [4 * 2 * 32768, 4 * 3 * 32768, 4 * 3 * 32768, 4 * 1 * 32768]
    # fp32 activations: 4 bytes instead of 2.
    assert pp_bytes_per_step(S, b, s, t, p, 1, m, act_bytes=4) == 2 * send_recv[1]
    assert pp_gather_bytes_per_step(S, b, s, t, p, 1, m, act_bytes=4) == 2 * gathers[1]


def test_matches_the_measured_zero_compare_rows():
    # benchmarks/results/2026-11-30-vm/rows.csv, S-TP2xPP2 (b 2, s 128, t 2, p 2, m 4, bf16): the comms
    # logger recorded pp 262720 bytes per rank (262144 + 8 meta tensors of 72 bytes, left out here) and
    # pp_gather 262144 (stage 0) / 131072 (stage 1); S-PP2xDP2 (t 1, m 2): pp 262144, no all-gather.
    assert [pp_bytes_per_step(S, 2, 128, 2, 2, stage, 4) for stage in (0, 1)] == [4 * 65536, 4 * 65536]
    assert [pp_gather_bytes_per_step(S, 2, 128, 2, 2, stage, 4) for stage in (0, 1)] == [262144, 131072]
    # t = 1: a message is the whole b·s·h·2 = 65536 bytes; one boundary, 2 messages, m = 2.
    assert [pp_bytes_per_step(S, 2, 128, 1, 2, stage, 2) for stage in (0, 1)] == [2 * 2 * 65536] * 2
    assert [pp_gather_bytes_per_step(S, 2, 128, 1, 2, stage, 2) for stage in (0, 1)] == [0, 0]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_no_pipeline_no_pipeline_traffic(tp):
    assert pp_bytes_per_step(S, 2, 128, tp, 1, 0, 8) == 0
    assert pp_gather_bytes_per_step(S, 2, 128, tp, 1, 0, 8) == 0


def test_partitioning_divides_by_t_and_adds_the_all_gather():
    b, s, p, m = 2, 128, 3, 2
    full = b * s * 128 * 2  # one unpartitioned bf16 message: 65536 bytes
    for t in (2, 4):
        whole = pp_bytes_per_step(S, b, s, t, p, 1, m, pipe_partitioned=False, grad_partitioned=False)
        assert whole == m * 2 * 2 * full  # middle stage: 2 boundaries x (activation + gradient)
        assert pp_bytes_per_step(S, b, s, t, p, 1, m) == whole // t
        assert pp_gather_bytes_per_step(S, b, s, t, p, 1, m, pipe_partitioned=False, grad_partitioned=False) == 0
        assert pp_gather_bytes_per_step(S, b, s, t, p, 1, m) == m * 3 * full // t
        # activations partitioned, gradients whole: 1/t one way, b·s·h the other; no gradient all-gather.
        half = pp_bytes_per_step(S, b, s, t, p, 1, m, grad_partitioned=False)
        assert half == m * 2 * (full // t + full)
        assert pp_gather_bytes_per_step(S, b, s, t, p, 1, m, grad_partitioned=False) == m * 2 * full // t
    # Without TP DeepSpeed does not partition (is_pipe_partitioned needs model parallelism).
    assert pp_bytes_per_step(S, b, s, 1, p, 1, m) == m * 2 * 2 * full
    with pytest.raises(ValueError, match="grad_partitioned"):
        pp_bytes_per_step(S, b, s, 2, p, 1, m, pipe_partitioned=False, grad_partitioned=True)
