"""Spawned gloo worlds for the tests (see hybrid3d.spawn).

Spawning a world costs seconds on 2 cores (imports dominate), so each world runs many checks
and returns their raw results; assertions then happen in the pytest process.
"""

from hybrid3d.parallel.spawn import free_port, run_world

__all__ = ["free_port", "run_world", "run_worlds_by_size"]


def run_worlds_by_size(fn, runs: list[dict], root, *args) -> dict:
    """One spawned world per distinct `run["world"]` size, each calling `fn(rank, size, its runs, *args)`, which
    returns {run name (or other key): report}; -> {run name: [report of each rank]}."""
    by_name = {}
    for world in sorted({r["world"] for r in runs}):
        members = [r for r in runs if r["world"] == world]
        ranks = run_world(fn, world, str(root / f"world{world}"), members, *args)
        for name in ranks[0]:
            by_name[name] = [rank[name] for rank in ranks]
    return by_name
