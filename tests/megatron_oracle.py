"""megatron-core's indexed dataset and blending helper, the test oracle for hybrid3d's own (`hybrid3d.data.indexed`,
`hybrid3d.data.blend`).

`import megatron.core.datasets.indexed_dataset` runs `megatron/core/__init__.py`, which imports megatron-core's
whole training stack (about 8 s here, and warnings about Transformer Engine). The two modules the tests need import
only `megatron.core.utils.log_single_rank` beyond themselves, so they are loaded with empty parent packages and that
one function, and the names are taken out of `sys.modules` again: a later real `import megatron.core` starts afresh.
"""

import importlib
import importlib.util
import sys
import types
from functools import lru_cache

import pytest


@lru_cache(maxsize=None)
def megatron_datasets() -> types.SimpleNamespace:
    """(indexed_dataset, helpers_cpp) of megatron-core; the calling test skips when it is not installed."""
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("megatron-core is not installed (launch/test.sh installs it: the indexed-data oracle)")
    root = list(spec.submodule_search_locations)[0]
    before = set(sys.modules)
    try:
        for name, path in (("megatron", root), ("megatron.core", f"{root}/core")):
            package = types.ModuleType(name)
            package.__path__ = [path]
            sys.modules[name] = package
        utils = types.ModuleType("megatron.core.utils")
        utils.log_single_rank = importlib.import_module("megatron.core._rank_utils").log_single_rank
        sys.modules["megatron.core.utils"] = utils
        return types.SimpleNamespace(indexed=importlib.import_module("megatron.core.datasets.indexed_dataset"),
                                     helpers=importlib.import_module("megatron.core.datasets.helpers_cpp"))
    finally:
        for name in set(sys.modules) - before:
            if name == "megatron" or name.startswith("megatron."):
                del sys.modules[name]
