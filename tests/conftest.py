"""Test tiers by folder: tests/unit runs in this process (the fast tier, `pytest -m "not slow"`);
tests/distributed spawns gloo worlds and tests/launcher runs the real `deepspeed` launcher (slow);
tests/gpu needs CUDA devices (`pytest -m gpu`). Tests marked `full` (NVMe offload, whose DeepSpeed op is the
longest build of all) run only with `--full` (`bash launch/test.sh --full`)."""

from pathlib import Path

import pytest

SLOW_FOLDERS = ("distributed", "launcher", "gpu")


def pytest_sessionfinish(session, exitstatus):
    import sys

    pool = sys.modules.get("tests.distributed.worlds")  # imported only when a test used the spawned worlds
    if pool is not None:
        pool.SESSION_POOL.close()


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="also run the full tier: tests marked `full` (NVMe offload through DeepSpeed's async I/O op)")


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).parent
    skip_full = pytest.mark.skip(reason="full tier: runs with --full (bash launch/test.sh --full), which also builds "
                                        "DeepSpeed's async I/O op it needs")
    for item in items:
        if "full" in item.keywords and not config.getoption("--full"):
            item.add_marker(skip_full)
        folder = Path(item.fspath).relative_to(root).parts[0]
        if folder in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)
        if folder == "gpu":
            item.add_marker(pytest.mark.gpu)
