"""Fault injection for reliability tests, loaded into launched ranks through PYTHONPATH (the faults themselves:
fault_patches.py, beside this file).

HYBRID3D_TEST_FAULT (JSON) selects one fault; nothing here runs without it:
- {"kind": "pause_in_save", "rank": R, "match": "global_step8", "marker": PATH}: rank R, about to
  write a checkpoint file whose path contains `match`, creates PATH and sleeps, so the test can
  kill -9 it in the middle of a save.
- {"kind": "nan_loss", "call": N}: the N-th call (1-based) of the language-model loss on each
  rank returns NaN, as a numerical blow-up would.
- {"kind": "hold_background_write", "rank": R, "match": "global_step2", "marker": PATH}: rank R's background
  writer (an asynchronous save), at its first file whose path contains `match`, creates PATH and holds the write
  until the rank receives SIGTERM (then 2 s more), so a test's signal meets a write in flight.
- {"kind": "pause_in_commit", "phase": "manifest" | "rename" | "latest", "marker": PATH},
  {"kind": "pause_in_prune", "marker": PATH}, {"kind": "pause_in_universal", "marker": PATH}: the rank that
  commits, prunes or converts (rank 0) creates PATH and sleeps at that point, so the test can kill -9 it there.
"""

import importlib.abc
import importlib.machinery
import json
import os
import sys
import time

import fault_patches

FAULT = json.loads(os.environ.get("HYBRID3D_TEST_FAULT", "null"))


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs `patch(module)` right after `name` is imported."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        original_exec = spec.loader.exec_module

        def exec_module(module):
            original_exec(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


def _mark(reason: str) -> None:
    """Tell the test where this rank is (the marker file), and go on."""
    with open(FAULT["marker"], "w") as f:
        f.write(reason)


def _pause(reason: str) -> None:
    """Tell the test where this rank is (the marker file) and wait to be killed."""
    _mark(reason)
    time.sleep(600)


def _hold_background_write(signals):
    import hybrid3d.checkpoint.async_save as async_save

    return fault_patches.patch_background_write_until_stop(signals, async_save, FAULT["rank"], FAULT["match"], _mark)


PATCHES = {  # kind -> (module patched right after its import, the patch)
    "pause_in_save": ("torch", lambda m: fault_patches.patch_save(m, FAULT["rank"], FAULT["match"], _pause)),
    "nan_loss": ("hybrid3d.model.llama", lambda m: fault_patches.patch_nan_loss(m, FAULT["call"])),
    "pause_in_commit": ("hybrid3d.checkpoint.commit",
                        lambda m: fault_patches.patch_commit(m, FAULT["phase"], "global_step8", _pause)),
    "pause_in_prune": ("hybrid3d.checkpoint.files", lambda m: fault_patches.patch_prune(m, _pause)),
    "pause_in_universal": ("hybrid3d.checkpoint.universal", lambda m: fault_patches.patch_universal(m, _pause)),
    "hold_background_write": ("hybrid3d.training.signals", _hold_background_write),
}

if FAULT:
    module, patch = PATCHES[FAULT["kind"]]
    sys.meta_path.insert(0, _PatchAfterImport(module, patch))
