"""Pipeline schedules as data: every order runs without deadlock, the timed runs reproduce the papers' bubble
formulas, in-flight passes follow Megatron's memory factor, and the interleaved instructions pair every send
with a receive in the same order on both ranks."""

from collections import Counter, defaultdict

import pytest
from deepspeed.runtime.pipe import schedule as ds_schedule

from hybrid3d.errors import LayoutError
from hybrid3d.parallel.pipeline_schedules import (
    InterleavedSchedule,
    PassOp,
    ideal_bubble,
    interleaved_order,
    peak_in_flight,
    run_timeline,
    schedule_orders,
    weighted_peak_in_flight,
)

CASES = [(p, v, m) for p in (2, 4, 8) for v in (2, 3, 4) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize("p, v, m", CASES)
def test_interleaved_orders_run_every_pass_once_and_match_the_formula(p, v, m):
    orders = schedule_orders("interleaved", p, m, v)
    for rank, order in enumerate(orders):
        assert Counter(order) == Counter(PassOp(f, i, rank + k * p) for f in (True, False) for i in range(m)
                                         for k in range(v))
    # Narayanan et al. 2021: (p-1)/(v·m+p-1) with equal stages, whatever the backward/forward ratio
    for backward in (1.0, 2.0, 3.0):
        assert run_timeline(orders, 1.0, backward).bubble_fraction() == pytest.approx(
            (p - 1) / (v * m + p - 1), rel=1e-12)


@pytest.mark.parametrize("schedule, p, v", [("1f1b", 4, 1), ("interleaved", 2, 2), ("interleaved", 4, 3),
                                            ("dualpipev", 2, 1), ("dualpipev", 4, 1)])
def test_the_weighted_peak_from_the_front_is_the_scan_of_the_whole_order(schedule, p, v):
    """The planner's weighted peak (the order's undominated in-flight counts) equals walking the order, for weights
    that favour either stage of a rank and equal ones."""
    import random

    rng = random.Random(0)
    for m in (2 * p, 4 * p + 1 if schedule == "1f1b" else 4 * p):
        for rank, order in enumerate(schedule_orders(schedule, p, m, v)):
            stages = sorted({op.stage for op in order})
            for weights in [dict.fromkeys(stages, 1.0)] + [{s: rng.uniform(0, 3e9) for s in stages} for _ in range(4)]:
                assert weighted_peak_in_flight(schedule, p, m, v, rank, weights) == pytest.approx(
                    peak_in_flight(order, weights.__getitem__), rel=1e-12)


@pytest.mark.parametrize("p, m", [(2, 2), (2, 8), (4, 4), (4, 16), (8, 24)])
def test_one_f_one_b_matches_the_formula_and_holds_p_minus_r_micro_batches(p, m):
    orders = schedule_orders("1f1b", p, m)
    assert run_timeline(orders, 1.0, 2.0).bubble_fraction() == pytest.approx((p - 1) / (m + p - 1), rel=1e-12)
    assert [peak_in_flight(o) for o in orders] == [min(p - r, m) for r in range(p)]


def test_a_slower_last_stage_sets_the_pace():
    """1F1B at p = 2, m = 4 with stage 1 1.5x slower (forward 1.5, backward 3 against 1 and 2): stage 1 never
    waits once started, so the step lasts t0f + m·(t1f + t1b) + t0b = 1 + 18 + 2 = 21 and the ranks are busy
    4·3 + 4·4.5 = 30 of 2 x 21: bubble 2/7, not the balanced formula's 1/5."""
    timeline = run_timeline(schedule_orders("1f1b", 2, 4), stage_times={0: (1.0, 2.0), 1: (1.5, 3.0)})
    assert timeline.bubble_fraction() == pytest.approx(1 - 30 / 42, rel=1e-12)


def test_interleaving_costs_megatrons_activation_factor():
    """Rank 0 holds (1 + (p-1)/(p·v)) times 1F1B's p micro-batches of its layers (Narayanan et al. 2021, §2.2),
    counted in 1/v-sized chunks: p·v + p - 1 chunk passes once m >= 2p."""
    for p, v in [(2, 2), (4, 2), (4, 4), (8, 2)]:
        peak = peak_in_flight(interleaved_order(p, v, 4 * p, 0))
        assert peak == p * v + p - 1
        assert peak / v == pytest.approx(p * (1 + (p - 1) / (p * v)))


def test_dualpipev_orders_come_from_deepspeeds_schedule_and_beat_1f1b():
    for p, m in [(2, 4), (2, 16), (4, 8), (4, 16)]:
        orders = schedule_orders("dualpipev", p, m)
        assert {op.stage for op in orders[0]} == {0, 2 * p - 1}
        assert ideal_bubble("dualpipev", p, m) < ideal_bubble("1f1b", p, m)


def test_a_bad_order_is_reported_as_a_deadlock():
    orders = [[PassOp(False, 0, 0), PassOp(True, 0, 0)], [PassOp(True, 0, 1), PassOp(False, 0, 1)]]
    with pytest.raises(RuntimeError, match="deadlock"):
        run_timeline(orders)
    with pytest.raises(LayoutError, match="divisible by pipeline ranks"):
        interleaved_order(4, 2, 6, 0)


def _messages(p, v, m, forward_only=False):
    """Per rank: [(round, kind, peer, buffer, chunk)] of its sends and receives, and its passes per buffer."""
    comms, passes = defaultdict(list), defaultdict(list)
    for rank in range(p):
        for t, step in enumerate(InterleavedSchedule(m, p, rank, v, forward_only).steps()):
            committed = any(isinstance(c, ds_schedule.CommitP2P) for c in step)
            for cmd in step:
                kw = cmd.kwargs
                if "peer" in kw:
                    assert committed
                    comms[rank].append((t, type(cmd).__name__, kw["peer"], kw["buffer_id"], kw["chunk"]))
                elif isinstance(cmd, (ds_schedule.ForwardPass, ds_schedule.BackwardPass)):
                    passes[rank].append((t, type(cmd).__name__, kw["buffer_id"], kw["chunk"]))
    return comms, passes


@pytest.mark.parametrize("p, v, m, forward_only", [(2, 2, 4, False), (4, 2, 8, False), (4, 3, 4, False),
                                                   (2, 2, 4, True), (4, 2, 8, True)])
def test_interleaved_instructions_pair_sends_and_receives_in_order(p, v, m, forward_only):
    comms, passes = _messages(p, v, m, forward_only)
    pairs = {"SendActivation": "RecvActivation", "SendGrad": "RecvGrad"}
    for sender in range(p):
        for receiver in range(p):
            sent = [(t, k) for t, k, peer, _, _ in comms[sender] if k in pairs and peer == receiver]
            got = [(t, k) for t, k, peer, _, _ in comms[receiver] if k in pairs.values() and peer == sender]
            # the same messages, round by round, in the same order: what point-to-point matching needs
            assert [(t, pairs[k]) for t, k in sent] == got
    for rank in range(p):
        for t, kind, peer, buffer, chunk in comms[rank]:
            assert peer in ((rank + 1) % p, (rank - 1) % p)
            if kind.startswith("Recv"):  # the pass that consumes a message runs in a later round
                consumer = "ForwardPass" if kind == "RecvActivation" else "BackwardPass"
                assert [u for u, k, b, c in passes[rank] if (k, b, c) == (consumer, buffer, chunk)][0] > t
    expected = p * v * m * (1 if forward_only else 2) // p
    assert all(len(passes[r]) == expected for r in range(p))


def test_interleaved_schedule_loads_inputs_on_the_first_stage_and_labels_on_the_last():
    m = 4
    for p, rank, loads in [(2, 0, [0, 1, 2, 3]), (2, 1, [4, 5, 6, 7]), (4, 1, []), (4, 2, []), (4, 3, [4, 5, 6, 7])]:
        steps = InterleavedSchedule(m, p, rank, 2).steps()
        assert [c.buffer_id for step in steps for c in step if isinstance(c, ds_schedule.LoadMicroBatch)] == loads
