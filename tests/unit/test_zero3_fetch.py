"""The replay of ZeRO-3's parameter coordinator (planning/zero3_fetch.py) on a three-module chain worked by hand from
DeepSpeed's rules (runtime/zero/partitioned_param_coordinator.py); tests/distributed/test_zero3_memory.py checks the
replay against DeepSpeed itself on a real model."""

import pytest

from hybrid3d.planning.zero3_fetch import Module, Zero3Knobs, replay_micro_batch

# a top module without parameters running M1, M2, M3, one parameter of 100 elements each (ids 0, 1, 2)
NUMELS = [100, 100, 100]
CHAIN = Module((), (Module((0,)), Module((1,)), Module((2,))))


@pytest.mark.parametrize("knobs, gathered, collectives, peak", [
    # no prefetch, no reuse: each module gathers its parameter and releases it, forward and backward
    (Zero3Knobs(persistence_threshold=0, prefetch_bucket=0, max_reuse_distance=0), (0, 1, 2, 2, 1, 0), 6, 100),
    # reuse within 250 elements: at M1's release the trace ahead reaches 300 elements before M1's backward, so M1
    # is released and gathered again; M2 (200 ahead) and M3 stay gathered into the backward, released after it
    (Zero3Knobs(persistence_threshold=0, prefetch_bucket=0, max_reuse_distance=250), (0, 1, 2, 0), 4, 200),
    # a 150-element prefetch bucket: the top module's fetch prefetches M1 and M2 in one gather, M1's prefetches M3
    # and walks the rest of the trace, marking every parameter for its backward use: nothing is released
    (Zero3Knobs(persistence_threshold=0, prefetch_bucket=150, max_reuse_distance=0), (0, 1, 2), 2, 300),
    # parameters at or below the persistence threshold are never gathered
    (Zero3Knobs(persistence_threshold=100, prefetch_bucket=0, max_reuse_distance=0), (), 0, 0),
])
def test_the_chain_worked_by_hand(knobs, gathered, collectives, peak):
    fetch = replay_micro_batch(NUMELS, CHAIN, knobs)
    assert (fetch.gathered, fetch.collectives, fetch.peak_available) == (gathered, collectives, peak)


def test_knobs_read_from_deepspeeds_keys():
    knobs = Zero3Knobs.from_zero_config({"stage3_max_live_parameters": 1e8, "stage3_prefetch_bucket_size": "auto"})
    assert knobs == Zero3Knobs(max_live=100_000_000)
    assert knobs.changed() == {"max_live": 100_000_000}
