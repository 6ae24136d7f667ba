"""Fault injection for reliability tests, loaded into launched ranks through PYTHONPATH.

HYBRID3D_TEST_FAULT (JSON) selects one fault; nothing here runs without it:
- {"kind": "pause_in_save", "rank": R, "match": "global_step8", "marker": PATH}: rank R, about to
  write a checkpoint file whose path contains `match`, creates PATH and sleeps, so the test can
  kill -9 it in the middle of a save.
- {"kind": "nan_loss", "call": N}: the N-th call (1-based) of the language-model loss on each
  rank returns NaN, as a numerical blow-up would.
"""

import importlib.abc
import importlib.machinery
import json
import os
import sys
import time

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


def _pause_in_save(torch):
    original = torch.save

    def save(obj, f, *args, **kwargs):
        if int(os.environ.get("RANK", -1)) == FAULT["rank"] and FAULT["match"] in str(f):
            open(FAULT["marker"], "w").close()
            time.sleep(600)
        return original(obj, f, *args, **kwargs)

    torch.save = save


def _nan_loss(llama):
    original = llama.LanguageModelLoss.__call__
    calls = [0]

    def call(self, logits, targets):
        loss = original(self, logits, targets)
        calls[0] += 1
        return loss * float("nan") if calls[0] == FAULT["call"] else loss

    llama.LanguageModelLoss.__call__ = call


if FAULT and FAULT["kind"] == "pause_in_save":
    sys.meta_path.insert(0, _PatchAfterImport("torch", _pause_in_save))
elif FAULT and FAULT["kind"] == "nan_loss":
    sys.meta_path.insert(0, _PatchAfterImport("hybrid3d.model.llama", _nan_loss))
