"""Sequence and context parallelism, measured: the activation bytes autograd saves (saved-tensor hooks)
against the memory model, and the collective bytes DeepSpeed's comms logger records against the traffic
model, SP on/off and CP 1/2, in one spawned world of 2 ranks (bf16, one micro-batch per step)."""

import dataclasses

import pytest

from hybrid3d.ds_internals.comms_callers import CALLER_CLASSES
from hybrid3d.model import LlamaShape
from hybrid3d.planning.activations import activation_bytes
from hybrid3d.planning.traffic import (
    cp_bytes_per_step,
    cp_loss_bytes_per_step,
    dp_bytes_per_step,
    tp_bus_bytes,
    tp_bytes_by_op,
    tp_messages,
)
from tests.distributed.worlds import run_world
from tests.distributed.sequence_worker import MICRO_BATCH, SEQ, SHAPE, measure_runs

WORLD = 2
RUNS = [dict(name="TP1-DP2", tp=1, cp=1, sp=False), dict(name="TP2", tp=2, cp=1, sp=False),
        dict(name="TP2+SP", tp=2, cp=1, sp=True), dict(name="CP2", tp=1, cp=2, sp=False),
        # masked attention: one shared mask, kv heads repeated (and RoPE's tables per token with documents)
        dict(name="TP2-window", tp=2, cp=1, sp=False, window=16), dict(name="TP2-documents", tp=2, cp=1, sp=False,
                                                                       documents=True),
        # ring attention: kv heads as they are, RoPE rows gathered per block, no shared mask
        dict(name="ring-CP2", tp=1, cp=2, sp=False, comm="p2p"),
        dict(name="ring-CP2-documents", tp=1, cp=2, sp=False, comm="p2p", documents=True),
        # the head and cross entropy 48 tokens at a time: each token's log-sum-exp kept, not its probabilities
        dict(name="TP2-chunked-loss", tp=2, cp=1, sp=False, chunk=48),
        dict(name="TP2+SP-chunked-loss", tp=2, cp=1, sp=True, chunk=48)]
# callers (the functions that issue the collective) by parallelism
TP_CALLERS = {caller for caller, kind in CALLER_CLASSES.items() if kind == "tp"}  # the benchmarks' classification
CP_CALLERS = {"single_all_to_all", "sequence_mean"}
DP_CALLERS = {"allreduce_bucket", "all_gather_into_tensor_dp_groups"}
ACTIVATION_TOL = 64  # bytes: measured within 28 bytes of 0.4-0.8 MB (saved scalars the model leaves out)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return run_world(measure_runs, WORLD, str(tmp_path_factory.mktemp("sequence")), RUNS)[0]


def by_op(comms: dict, callers: set) -> dict:
    out = {}
    for (op, caller), size in comms.items():
        if caller in callers:
            out[op] = out.get(op, 0) + size
    return out


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r["name"])
def test_saved_activation_bytes_match_the_memory_model(measured, run):
    shape = LlamaShape(**SHAPE, sliding_window=run.get("window"), loss_chunk_tokens=run.get("chunk", 0))
    model = activation_bytes(shape, MICRO_BATCH, SEQ, run["tp"], 1, 0, 1, sequence_parallel=run["sp"], cp=run["cp"],
                             document_mask=run.get("documents", False), comm=run.get("comm", "a2a"))
    got = measured[run["name"]]["activations"]
    print(f"{run['name']}: measured {got:,} bytes, modelled {model:,.0f}")
    assert abs(got - model) <= ACTIVATION_TOL, (got, model)


def test_sp_and_cp_shrink_activations_as_modelled(measured):
    """The effects themselves, measured: SP divides the norms' share by t, CP every per-token term by c."""
    shape = LlamaShape(**SHAPE)

    def model(tp, sp, cp):
        return activation_bytes(shape, MICRO_BATCH, SEQ, tp, 1, 0, 1, sequence_parallel=sp, cp=cp)

    sp_ratio = measured["TP2+SP"]["activations"] / measured["TP2"]["activations"]
    cp_ratio = measured["CP2"]["activations"] / measured["TP1-DP2"]["activations"]
    assert sp_ratio < 0.75 and cp_ratio < 0.6
    # the byte bound above, relative: ~1e-4 of these 0.4-0.8 MB
    assert sp_ratio == pytest.approx(model(2, True, 1) / model(2, False, 1), rel=3e-4)
    assert cp_ratio == pytest.approx(model(1, False, 2) / model(1, False, 1), rel=3e-4)


@pytest.mark.parametrize("run", [r for r in RUNS if r["tp"] > 1], ids=lambda r: r["name"])
def test_tp_collectives_match_the_traffic_model(measured, run):
    shape = LlamaShape(**SHAPE)
    model = {op: n for op, n in tp_bytes_by_op(shape, MICRO_BATCH, SEQ, run["tp"], 1, 0, 1,
                                                sequence_parallel=run["sp"]).items() if n}
    assert by_op(measured[run["name"]]["comms"], TP_CALLERS) == model
    # and as many messages (what the planner's per-message latency counts): the chunked loss's per chunk
    counts = {}
    chunked = dataclasses.replace(shape, loss_chunk_tokens=run.get("chunk", 0))
    for op, count, _ in tp_messages(chunked, MICRO_BATCH, SEQ, run["tp"], 1, 0, 1, sequence_parallel=run["sp"]):
        counts[op] = counts.get(op, 0) + count
    assert by_op(measured[run["name"]]["messages"], TP_CALLERS) == {op: n for op, n in counts.items() if n}


def test_sp_moves_the_bus_bytes_of_tp_plus_the_backward_regathers(measured):
    """Korthikanti et al. 2022, §4.2.2: reduce-scatter + all-gather = all-reduce. The extras of SP here:
    the re-gathers of the saved input shards (q/k/v, gate/up per block, the LM head) and the norm weights'
    gradient all-reduces."""
    t, h, layers = 2, SHAPE["hidden_size"], SHAPE["num_layers"]
    tp_ops = by_op(measured["TP2"]["comms"], TP_CALLERS)
    sp_ops = by_op(measured["TP2+SP"]["comms"], TP_CALLERS)
    shard = MICRO_BATCH * SEQ * h * 2 // t  # bf16 (b, s/t, h)
    regathers = (2 * layers + 1) * shard * (t - 1)
    norms = (2 * layers + 1) * h * 2 * 2 * (t - 1) / t
    assert tp_bus_bytes(sp_ops, t) == pytest.approx(tp_bus_bytes(tp_ops, t) + regathers + norms)


def test_cp_and_dp_collectives_match_the_traffic_model(measured):
    shape = LlamaShape(**SHAPE)
    comms = measured["CP2"]["comms"]
    assert by_op(comms, {"single_all_to_all"}) == {
        "all_to_all_single": cp_bytes_per_step(shape, MICRO_BATCH, SEQ, 1, 2, 1, 0, 1)}
    assert by_op(comms, {"sequence_mean"}) == {"all_reduce": cp_loss_bytes_per_step(2, 1)}
    # ZeRO reduces and partitions over DeepSpeed's d·c = 2 data-parallel ranks (CP folded in)
    assert sum(by_op(comms, DP_CALLERS).values()) == dp_bytes_per_step(shape, 1, 1, 2, 0, 1, 1, "bf16+fp32acc")
    assert not by_op(comms, TP_CALLERS)
