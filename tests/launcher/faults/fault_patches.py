"""The faults themselves, for launched ranks (sitecustomize.py, from HYBRID3D_TEST_FAULT) and for in-process
tests alike. Each `patch_*` changes one module of hybrid3d (or torch) so that the fault happens at one point;
`stop(reason)` is what happens there: a launched rank tells the test (a marker file) and waits to be killed -9,
an in-process test's forked child kills itself -9. Each returns a function that undoes the patch."""

import os
import threading
import time


def patch_save(torch, rank: int, match: str, stop):
    """Rank `rank`, about to write a checkpoint file whose path contains `match`, stops."""
    original = torch.save

    def save(obj, f, *args, **kwargs):
        if int(os.environ.get("RANK", -1)) == rank and match in str(f):
            stop("save")
        return original(obj, f, *args, **kwargs)

    torch.save = save
    return lambda: setattr(torch, "save", original)


def patch_nan_loss(llama, call: int):
    """The `call`-th call (1-based) of the language-model loss on each rank returns NaN, as a blow-up would."""
    original = llama.LanguageModelLoss.__call__
    calls = [0]

    def loss_call(self, logits, targets):
        loss = original(self, logits, targets)
        calls[0] += 1
        return loss * float("nan") if calls[0] == call else loss

    llama.LanguageModelLoss.__call__ = loss_call
    return lambda: setattr(llama.LanguageModelLoss, "__call__", original)


def patch_commit(commit, phase: str, tag: str, stop):
    """The commit of `tag` (checkpoint/commit.py) stops at `phase`: 'manifest' before the manifest is written,
    'rename' with the manifest written but the folder not renamed, 'latest' with the folder renamed and the new
    `latest` written to its temporary name but not moved into place."""
    write_meta, fsync_dir, fsync_file = commit.write_meta, commit.fsync_dir, commit.fsync_file

    def meta(tag_dir, content):
        if phase == "manifest" and commit.MANIFEST_KEY in content and tag in str(tag_dir):
            stop(phase)
        return write_meta(tag_dir, content)

    def sync_dir(path):
        if phase == "rename" and str(path).endswith(f"{tag}.incomplete"):
            stop(phase)
        return fsync_dir(path)

    def sync_file(path):
        if phase == "latest" and str(path).endswith(".latest.tmp") and open(path).read() == tag:
            stop(phase)
        return fsync_file(path)

    commit.write_meta, commit.fsync_dir, commit.fsync_file = meta, sync_dir, sync_file

    def undo():
        commit.write_meta, commit.fsync_dir, commit.fsync_file = write_meta, fsync_dir, fsync_file
    return undo


def patch_prune(files, stop):
    """Pruning (checkpoint/files.py): the first tag to go loses one file, then stops: a half-deleted tag."""
    real = files.shutil

    class Shutil:  # the module, with `rmtree` stopping half-way
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def rmtree(path, *args, **kwargs):
            victim = next((p for p in sorted(os.listdir(path)) if p.endswith(".pt")), None)
            if victim:
                os.remove(os.path.join(path, victim))
            stop("prune")
            return real.rmtree(path, *args, **kwargs)

    files.shutil = Shutil()
    return lambda: setattr(files, "shutil", real)


def patch_universal(universal, stop):
    """The universal conversion (checkpoint/universal.py): DeepSpeed's converter has run, the result is neither
    marked nor renamed into place."""
    real = universal.run_ds_to_universal

    def converted_then_stopped(*args, **kwargs):
        real(*args, **kwargs)
        stop("universal")

    universal.run_ds_to_universal = converted_then_stopped
    return lambda: setattr(universal, "run_ds_to_universal", real)


def patch_background_write_until_stop(signals, async_save, rank: int, match: str, reached):
    """Rank `rank`'s background writer (checkpoint/async_save.py), at the first file whose path contains `match`,
    calls `reached` and holds the write until the rank has received SIGTERM/SIGINT (the job's StopRequest handler
    ran), then 2 s more, so the stop the signal asks for meets the write still in flight."""
    stopped, held = threading.Event(), []
    handle, fsync_file = signals.StopRequest._handle, async_save.fsync_file

    def on_signal(self, signum, frame):
        handle(self, signum, frame)
        stopped.set()

    def fsync_held(path):
        if not held and int(os.environ.get("RANK", -1)) == rank and match in str(path):
            held.append(path)
            reached("background write")
            stopped.wait(300)
            time.sleep(2)
        return fsync_file(path)

    signals.StopRequest._handle, async_save.fsync_file = on_signal, fsync_held

    def undo():
        signals.StopRequest._handle, async_save.fsync_file = handle, fsync_file
    return undo
