"""Where each rank runs, and whether the layout keeps its chatty groups inside a node.

Megatron-LM's placement (Narayanan et al. 2021, §3.3): tensor parallelism, with all-reduces in every block,
inside a node (NVLink); data parallelism and pipeline stages, one gradient reduction a step or one activation
a micro-batch, across nodes. hybrid3d's rank order puts the t ranks of a TP group, and the c·t ranks of a
TP x CP block, next to each other (`layout.py`), and DeepSpeed's launcher numbers ranks node by node (node n
holds ranks [Σ slots before n, + slots of n)), so a block stays in a node whenever every node's slot count
is a multiple of c·t. `blocks_across_nodes` finds the blocks that do not; the job prints them as warnings.

A node is what the launcher says: DeepSpeed's launcher sets CROSS_RANK (the node's index in the hostfile),
torchrun GROUP_RANK; without either, the host name. Hosts alone cannot tell apart two "nodes" started on one
machine (`deepspeed --no_ssh --node_rank r`), the launcher's index can.
"""

import os
import socket

import deepspeed.comm as dist

from hybrid3d.parallel.layout import ParallelLayout

LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")


def rank_place(layout: ParallelLayout, rank: int) -> dict:
    """This rank's host, launcher variables, node and coordinates in the layout."""
    coord = layout.topology().get_coord(rank)  # (pipe, data', model): data' = data·c + cp
    env = {key: os.environ.get(key) for key in LAUNCHER_ENV}
    node = os.environ.get("CROSS_RANK") or os.environ.get("GROUP_RANK")
    host = socket.gethostname()
    return {"rank": rank, "host": host, "node": f"{host}:{node}" if node is not None else host, "env": env,
            "stage": coord.pipe, "data": coord.data // layout.cp, "cp": coord.data % layout.cp, "tp": coord.model}


def gather_placement(layout: ParallelLayout) -> list[dict]:
    """Every rank's `rank_place`, in rank order (a collective)."""
    places = [None] * dist.get_world_size()
    dist.all_gather_object(places, rank_place(layout, dist.get_rank()))
    return places


def blocks_across_nodes(places: list[dict]) -> list[tuple[list[int], list[str]]]:
    """[(ranks, nodes)] of every TP x CP block (one stage, one data rank) whose ranks are on more than one node."""
    blocks = {}
    for place in places:
        blocks.setdefault((place["stage"], place["data"]), []).append(place)
    out = []
    for members in blocks.values():
        nodes = sorted({p["node"] for p in members})
        if len(nodes) > 1:
            out.append(([p["rank"] for p in members], nodes))
    return out


def placement_lines(places: list[dict], layout: ParallelLayout) -> list[str]:
    """One line per node (its ranks and pipeline stages), then one warning per block that crosses nodes."""
    nodes = {}
    for place in places:
        nodes.setdefault(place["node"], []).append(place)
    lines = []
    if len(nodes) > 1:
        for index, (node, members) in enumerate(nodes.items()):
            ranks = [p["rank"] for p in members]
            stages = sorted({p["stage"] for p in members})
            lines.append(f"  node {index} ({node}): ranks {_span(ranks)}, pipeline stage(s) {_span(stages)}")
    group = "TP x CP block" if layout.cp > 1 else "TP group"
    for ranks, crossed in blocks_across_nodes(places):
        lines.append(f"warning: {group} of ranks {_span(ranks)} spans nodes {', '.join(crossed)}: its collectives "
                     f"cross the network; give every node a multiple of {layout.tp * layout.cp} ranks "
                     f"(tensor_parallel_size x context_parallel_size; hostfile slots)")
    return lines


def _span(values: list[int]) -> str:
    values = sorted(values)
    if values == list(range(values[0], values[-1] + 1)) and len(values) > 1:
        return f"{values[0]}-{values[-1]}"
    return ",".join(str(v) for v in values)
