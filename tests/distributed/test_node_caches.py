"""The data cache is filled once per host, however many ranks the host runs and whether hosts share the cache.

A world of 4 plays two hosts of two ranks, each host with its own cache folder (LOCAL_RANK = rank % 2,
HYBRID3D_CACHE per host). `node_leaders_first` runs the build on both hosts' first ranks at once, then on the
others, which find their host's cache: two builds. `rank0_first` (what the job used) built three times: rank 0,
then both ranks of the second host at once, neither seeing the other's."""

import os
import time

from tests.distributed.worlds import run_world


def _builds_per_host(rank: int, world_size: int, root: str) -> dict:
    from hybrid3d.training.job import node_leaders_first

    saved = {k: os.environ.get(k) for k in ("LOCAL_RANK", "HYBRID3D_CACHE")}
    os.environ.update(LOCAL_RANK=str(rank % 2), HYBRID3D_CACHE=os.path.join(root, f"host{rank // 2}"))

    def build():  # a cache fill that takes a while: whoever finds no cache builds it
        marker = os.path.join(os.environ["HYBRID3D_CACHE"], "packed")
        if os.path.exists(marker):
            return "read"
        time.sleep(0.3)
        os.makedirs(marker, exist_ok=True)
        return "built"

    try:
        return {"did": node_leaders_first(build, rank)}
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)


def test_each_host_builds_its_cache_once(tmp_path):
    results = run_world(_builds_per_host, 4, str(tmp_path), str(tmp_path / "caches"))
    assert [r["did"] for r in results] == ["built", "read", "built", "read"]
    assert sorted(os.listdir(tmp_path / "caches")) == ["host0", "host1"]
