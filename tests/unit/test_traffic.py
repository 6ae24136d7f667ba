"""Pipeline traffic of DeepSpeed's PipelineEngine (1F1B TrainSchedule): send/recv bytes at stage
boundaries and the TP all-gathers that re-assemble partitioned messages; sequence parallelism's
all-gathers and reduce-scatters, Ulysses' all-to-alls (hybrid3d.planning.traffic), against hand counts."""

import pytest

from hybrid3d.model import LlamaShape
from hybrid3d.planning.traffic import (
    cp_bytes_per_step,
    dp_bytes_per_step,
    pp_bytes_per_step,
    pp_gather_bytes_per_step,
    pp_message_bytes,
    tp_bus_bytes,
    tp_bytes_by_op,
    tp_bytes_per_step,
)

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


# One decoder block per stage: S with 3 layers over 3 stages (the middle stage has no embedding or head).
S3 = LlamaShape(vocab_size=4096, hidden_size=128, intermediate_size=352, num_layers=3, num_heads=4, num_kv_heads=2,
                head_dim=32)


def test_sequence_parallel_traffic_of_one_block_by_hand():
    # b 2, s 128, h 128, bf16, t 2: x = b·s·h·2 = 65536 bytes (reduce-scatter input), x/t = 32768 (all-gather input).
    b, s, t = 2, 128, 2
    mid = tp_bytes_by_op(S3, b, s, t, 3, 1, 1, sequence_parallel=True)
    # forward 2 AG + 2 RS; backward 4 AG + 2 RS + the two RMSNorm weight gradients, 2·h·2 = 512 bytes.
    assert mid == {"all_gather_into_tensor": 6 * 32768, "reduce_scatter_tensor": 4 * 65536, "all_reduce": 512}
    again = tp_bytes_by_op(S3, b, s, t, 3, 1, 1, recompute=True, sequence_parallel=True)
    assert again == {"all_gather_into_tensor": 8 * 32768, "reduce_scatter_tensor": 6 * 65536, "all_reduce": 512}
    # first stage: + the embedding's RS forward and AG backward; last: + the head's AG forward and backward
    # and RS backward, the final norm's gradient (256) and the cross entropy, 3·b·s·4 = 3072 bytes.
    first = tp_bytes_by_op(S3, b, s, t, 3, 0, 1, sequence_parallel=True)
    last = tp_bytes_by_op(S3, b, s, t, 3, 2, 1, sequence_parallel=True)
    assert first == {"all_gather_into_tensor": 7 * 32768, "reduce_scatter_tensor": 5 * 65536, "all_reduce": 512}
    assert last == {"all_gather_into_tensor": 8 * 32768, "reduce_scatter_tensor": 5 * 65536,
                    "all_reduce": 512 + 256 + 3072}
    # m micro-batches: m times; tp_bytes_per_step is the sum over ops.
    assert tp_bytes_per_step(S3, b, s, t, 3, 1, 4, sequence_parallel=True) == 4 * (6 * 32768 + 4 * 65536 + 512)
    # Without SP: 4 all-reduces of x per block (unchanged), over s/c tokens with CP.
    assert tp_bytes_by_op(S3, b, s, t, 3, 1, 1) == {"all_reduce": 4 * 65536, "all_gather_into_tensor": 0,
                                                    "reduce_scatter_tensor": 0}
    assert tp_bytes_per_step(S3, b, s, t, 3, 1, 1, cp=2) == 4 * 32768
    assert tp_bytes_by_op(S3, b, s, 1, 3, 1, 1) == dict.fromkeys(("all_reduce", "all_gather_into_tensor",
                                                                  "reduce_scatter_tensor"), 0)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_sequence_parallel_forward_costs_an_all_reduce_on_the_bus(t):
    x = 2 * 128 * 128 * 2
    assert tp_bus_bytes({"reduce_scatter_tensor": x, "all_gather_into_tensor": x // t}, t) == \
        pytest.approx(tp_bus_bytes({"all_reduce": x}, t)) == pytest.approx(2 * x * (t - 1) / t)


def test_sequence_parallel_extra_bus_bytes_are_the_backward_regathers():
    # t 2, one block: SP moves AG 6·32768·(t-1) + RS 4·65536·(t-1)/t + AR 512·2(t-1)/t = 328192 bytes;
    # TP's 4 all-reduces 4·65536·2(t-1)/t = 262144: the difference is 2 all-gathers of x/t and the norms.
    sp = tp_bus_bytes(tp_bytes_by_op(S3, 2, 128, 2, 3, 1, 1, sequence_parallel=True), 2)
    tp = tp_bus_bytes(tp_bytes_by_op(S3, 2, 128, 2, 3, 1, 1), 2)
    assert (sp, tp) == (328192, 262144)
    assert sp - tp == 2 * 32768 + 512


def test_ulysses_all_to_all_bytes_with_kv_repetition():
    # S: a 4, kv 2, head dim 32, 4 layers; b 2, s 128, c 2 -> s/c = 64, bf16.
    b, s = 2, 128
    # t 2: one kv head per TP rank, repeated to c = 2 for the exchange. q and the output: b·64·(a/t)·32 = 8192
    # elements, k and v: b·64·2·32 = 8192 each; 4 all-to-alls x 2 bytes = 65536 bytes a block forward.
    assert cp_bytes_per_step(S, b, s, 2, 2, 1, 0, 1) == 4 * 2 * 65536  # 4 blocks, forward + backward
    assert cp_bytes_per_step(S, b, s, 2, 2, 1, 0, 3, recompute=True) == 3 * 4 * 3 * 65536
    # t 1: q and output b·64·4·32 = 16384 elements, k and v (2 kv heads, one per CP rank) 8192.
    assert cp_bytes_per_step(S, b, s, 1, 2, 1, 0, 1) == 4 * 2 * (2 * 16384 + 2 * 8192) * 2
    assert cp_bytes_per_step(S, b, s, 2, 1, 1, 0, 1) == 0
    odd = LlamaShape(vocab_size=4096, hidden_size=384, intermediate_size=512, num_layers=2, num_heads=12,
                     num_kv_heads=6, head_dim=32)
    with pytest.raises(ValueError, match="divide one another"):  # 6 kv heads and c 4
        cp_bytes_per_step(odd, b, s, 1, 4, 1, 0, 1)


def test_pipeline_messages_with_sequence_parallelism():
    # SP: each TP rank sends its (b, s/t, h) shard, b·s·h/t·2 = 32768 bytes at t 2 (16384 at t 4), whatever
    # the partitioning flags (hybrid3d turns them off), and nothing is all-gathered.
    b, s, p, m = 2, 128, 4, 4
    assert pp_message_bytes(S, b, s, 2, sequence_parallel=True) == 32768
    assert pp_message_bytes(S, b, s, 4, sequence_parallel=True) == 16384
    send_recv = [pp_bytes_per_step(S, b, s, 2, p, stage, m, sequence_parallel=True) for stage in range(p)]
    assert send_recv == [4 * 1 * 65536, 4 * 2 * 65536, 4 * 2 * 65536, 4 * 1 * 65536]
    assert pp_bytes_per_step(S, b, s, 2, p, 1, m, pipe_partitioned=False, grad_partitioned=False,
                             sequence_parallel=True) == send_recv[1]
    assert [pp_gather_bytes_per_step(S, b, s, 2, p, st, m, sequence_parallel=True) for st in range(p)] == [0] * 4


def test_dp_bytes_over_the_sequence_data_parallel_group():
    # G-like shape of test_memory_model (Ψ = 106816, a multiple of 2·4): ZeRO-1 over d·c = 4 ranks
    # all-reduces Ψ bf16 gradients (2Ψ bytes; fp32 accumulation does not change the communication dtype)
    # and all-gathers a Ψ/4 bf16 partition.
    g = LlamaShape(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16)
    psi = 106816
    assert dp_bytes_per_step(g, 1, 1, 2 * 2, 0, 1, 1, "bf16+fp32acc") == 2 * psi + 2 * psi // 4
