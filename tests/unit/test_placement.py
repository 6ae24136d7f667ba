"""Rank placement over nodes (hybrid3d/parallel/placement.py): which TP (x CP) blocks cross a node boundary,
for the launcher's node-by-node rank numbering and hybrid3d's TP-innermost rank order."""

from hybrid3d.parallel.layout import ParallelLayout
from hybrid3d.parallel.placement import blocks_across_nodes, placement_lines, rank_place


def places(layout: ParallelLayout, slots: list[int]) -> list[dict]:
    """Every rank's place when node n holds the next slots[n] ranks (DeepSpeed's launcher order)."""
    nodes = [n for n, count in enumerate(slots) for _ in range(count)]
    out = []
    for rank, node in enumerate(nodes):
        place = rank_place(layout, rank)
        place["node"] = f"node{node}"
        out.append(place)
    return out


def test_tp_groups_stay_inside_nodes_with_slots_a_multiple_of_tp():
    layout = ParallelLayout(tp=2, pp=2, dp=1)
    two_nodes = places(layout, [2, 2])
    assert blocks_across_nodes(two_nodes) == []
    assert [p["stage"] for p in two_nodes] == [0, 0, 1, 1]  # the pipeline crosses the nodes, TP does not
    lines = placement_lines(two_nodes, layout)
    assert lines == ["  node 0 (node0): ranks 0-1, pipeline stage(s) 0", "  node 1 (node1): ranks 2-3, pipeline stage(s) 1"]


def test_a_tp_group_across_nodes_is_named():
    layout = ParallelLayout(tp=2, pp=1, dp=3)
    crossed = places(layout, [3, 3])  # ranks 2 and 3 form a TP group on two nodes
    assert blocks_across_nodes(crossed) == [([2, 3], ["node0", "node1"])]
    warning = placement_lines(crossed, layout)[-1]
    assert warning.startswith("warning: TP group of ranks 2-3 spans nodes node0, node1")
    assert "multiple of 2 ranks" in warning


def test_tp_times_cp_blocks_count_as_one():
    layout = ParallelLayout(tp=2, pp=1, dp=2, cp=2)  # blocks of 4 ranks: a 2-rank node splits each
    assert len(blocks_across_nodes(places(layout, [2, 2, 2, 2]))) == 2
    assert blocks_across_nodes(places(layout, [4, 4])) == []


def test_a_vanished_peer_becomes_one_line_naming_the_phase():
    import pytest

    from hybrid3d.errors import PeerLostError
    from hybrid3d.training.watchdog import Watchdog

    gloo = RuntimeError("[/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:5530. This is "
                        "typically caused by a remote worker crashing.")
    with pytest.raises(PeerLostError, match=r"^rank 3: lost contact with another rank in step 7 \(Connection closed "
                                            r"by peer \[10.0.0.2\]:5530\): a rank or its node stopped"):
        with Watchdog(60, rank=3) as watchdog:
            watchdog.beat("step 7")
            raise gloo
    with pytest.raises(RuntimeError, match="out of memory"):  # other errors pass unchanged
        with Watchdog(60, rank=3):
            raise RuntimeError("CUDA out of memory")
