"""Fault injection for reliability tests, loaded into launched ranks through PYTHONPATH.

HYBRID3D_TEST_FAULT (JSON) selects one fault; nothing here runs without it:
- {"kind": "pause_in_save", "rank": R, "match": "global_step8", "marker": PATH}: rank R, about to
  write a checkpoint file whose path contains `match`, creates PATH and sleeps, so the test can
  kill -9 it in the middle of a save.
- {"kind": "nan_loss", "call": N}: the N-th call (1-based) of the language-model loss on each
  rank returns NaN, as a numerical blow-up would.
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


def _pause(reason: str) -> None:
    """Tell the test where this rank is (the marker file) and wait to be killed."""
    with open(FAULT["marker"], "w") as f:
        f.write(reason)
    time.sleep(600)


def _pause_in_commit(commit):
    """Rank 0's commit of global_step8 (checkpoint/commit.py): 'manifest' before the manifest is written,
    'rename' with the manifest written but the folder not renamed, 'latest' with the folder renamed and the new
    `latest` written to its temporary name but not moved into place."""
    phase, write_meta, fsync_dir, fsync_file = FAULT["phase"], commit.write_meta, commit.fsync_dir, commit.fsync_file

    def meta(tag_dir, content):
        if phase == "manifest" and commit.MANIFEST_KEY in content and "global_step8" in str(tag_dir):
            _pause(phase)
        return write_meta(tag_dir, content)

    def sync_dir(path):
        if phase == "rename" and str(path).endswith("global_step8.incomplete"):
            _pause(phase)
        return fsync_dir(path)

    def sync_file(path):
        if phase == "latest" and str(path).endswith(".latest.tmp") and open(path).read() == "global_step8":
            _pause(phase)
        return fsync_file(path)

    commit.write_meta, commit.fsync_dir, commit.fsync_file = meta, sync_dir, sync_file


def _pause_in_prune(files):
    """Pruning (checkpoint/files.py): the first tag to go loses one file, then the rank waits: a half-deleted tag."""
    real = files.shutil

    class Shutil:  # the module, with `rmtree` stopping half-way
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def rmtree(path, *args, **kwargs):
            victim = next((p for p in sorted(os.listdir(path)) if p.endswith(".pt")), None)
            if victim:
                os.remove(os.path.join(path, victim))
            _pause("prune")
            return real.rmtree(path, *args, **kwargs)

    files.shutil = Shutil()


def _pause_in_universal(universal):
    """The universal conversion (checkpoint/universal.py): DeepSpeed's converter has run, the result is neither
    marked nor renamed into place."""
    real = universal.subprocess

    class Subprocess:  # the module, with `run` pausing after it returns
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def run(*args, **kwargs):
            result = real.run(*args, **kwargs)
            _pause("universal")
            return result

    universal.subprocess = Subprocess()


if FAULT and FAULT["kind"] == "pause_in_commit":
    sys.meta_path.insert(0, _PatchAfterImport("hybrid3d.checkpoint.commit", _pause_in_commit))
elif FAULT and FAULT["kind"] == "pause_in_prune":
    sys.meta_path.insert(0, _PatchAfterImport("hybrid3d.checkpoint.files", _pause_in_prune))
elif FAULT and FAULT["kind"] == "pause_in_universal":
    sys.meta_path.insert(0, _PatchAfterImport("hybrid3d.checkpoint.universal", _pause_in_universal))
elif FAULT and FAULT["kind"] == "pause_in_save":
    sys.meta_path.insert(0, _PatchAfterImport("torch", _pause_in_save))
elif FAULT and FAULT["kind"] == "nan_loss":
    sys.meta_path.insert(0, _PatchAfterImport("hybrid3d.model.llama", _nan_loss))
