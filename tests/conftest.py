"""Test tiers by folder: tests/unit runs in this process (the fast tier, `pytest -m "not slow"`);
tests/distributed spawns gloo worlds and tests/launcher runs the real `deepspeed` launcher (slow);
tests/gpu needs CUDA devices (`pytest -m gpu`)."""

from pathlib import Path

import pytest

SLOW_FOLDERS = ("distributed", "launcher", "gpu")


def pytest_sessionfinish(session, exitstatus):
    import sys

    pool = sys.modules.get("tests.distributed.worlds")  # imported only when a test used the spawned worlds
    if pool is not None:
        pool.SESSION_POOL.close()


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).parent
    for item in items:
        folder = Path(item.fspath).relative_to(root).parts[0]
        if folder in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)
        if folder == "gpu":
            item.add_marker(pytest.mark.gpu)
