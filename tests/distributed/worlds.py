"""Spawned gloo worlds for the tests (see hybrid3d.parallel.spawn).

Every test module runs its ranks in the session's pooled worlds (one per size, kept until the session
ends: tests/conftest.py closes them), so a world's start-up (seconds of imports on 2 cores) is paid once
per size, not once per module. Each world runs many checks and returns their raw results; assertions
then happen in the pytest process.
"""

from hybrid3d.parallel.spawn import WorldPool, end_run, free_port

__all__ = ["SESSION_POOL", "each_run", "free_port", "run_world", "run_worlds_by_size"]

SESSION_POOL = WorldPool(preload=True)  # ranks forked from one import of torch, DeepSpeed, transformers


def run_world(fn, world_size: int, result_dir: str, *args, timeout: float | None = None) -> list:
    """`fn(rank, world_size, *args)` on every rank of the session's world of `world_size`; each rank's result."""
    extra = {} if timeout is None else {"timeout": timeout}
    return SESSION_POOL.run(fn, world_size, str(result_dir), *args, **extra)


def run_worlds_by_size(fn, runs: list[dict], root, *args) -> dict:
    """One call per distinct `run["world"]` size, each `fn(rank, size, its runs, *args)`, which returns
    {run name (or other key): report}; -> {run name: [report of each rank]}."""
    by_name = {}
    for world in sorted({r["world"] for r in runs}):
        members = [r for r in runs if r["world"] == world]
        ranks = run_world(fn, world, str(root / f"world{world}"), members, *args)
        for name in ranks[0]:
            by_name[name] = [rank[name] for rank in ranks]
    return by_name


def each_run(runs: list[dict], one) -> dict:
    """On a rank: {run["name"]: one(run)} for `runs` in turn, each run's engines and groups freed before the next
    (a call of many runs would otherwise gather every run's gloo threads and retire its world)."""
    reports = {}
    for run in runs:
        reports[run["name"]] = one(run)
        end_run()
    return reports
