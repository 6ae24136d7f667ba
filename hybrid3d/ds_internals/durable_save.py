"""Every checkpoint file a rank writes reaches stable storage, and the rank says which it wrote.

DeepSpeed 0.19.8 writes all of a checkpoint's files through the engine's checkpoint engine
(`engine.checkpoint_engine.save(state_dict, path)`: the module, optimizer and layer files of
`runtime/engine.py` and `runtime/pipe/module.py` `save_state_dict`); its `TorchCheckpointEngine.save` is a
`torch.save`, which closes the file without an fsync. `record_saves` wraps that method on one engine: after each
file is written it is fsync'ed by the rank that wrote it (on a shared file system only the writing node can
flush its cache) and its path and size are recorded, so the commit can check every rank's files in rank 0's
view (checkpoint/commit.py). Files hybrid3d writes itself go through `fsync_file` and are recorded the same way.
`snapshot_saves` is the asynchronous save's side of the same seam (checkpoint/async_save.py): each file's state is
copied to host memory instead (checkpoint/host_copy.py), for a background thread to write.
"""

import os
from contextlib import contextmanager
from pathlib import Path


def fsync_file(path) -> int:
    """Flush `path` to stable storage; its size in bytes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def fsync_dir(path) -> None:
    """Make a directory's entries (a create, a rename) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def record_saves(engine, written: dict):
    """Inside the block, each file the engine's checkpoint engine saves is fsync'ed and `written[path] = bytes`."""
    checkpoint_engine = engine.checkpoint_engine
    original = checkpoint_engine.save

    def save(state_dict, path, *args, **kwargs):
        result = original(state_dict, path, *args, **kwargs)
        written[str(Path(path))] = fsync_file(path)
        return result

    checkpoint_engine.save = save
    try:
        yield written
    finally:
        checkpoint_engine.save = original


@contextmanager
def snapshot_saves(engine, snapshot):
    """Inside the block, each file the engine's checkpoint engine would save goes to `snapshot.add(path, state,
    zipfile)` instead (checkpoint/host_copy.Snapshot: a host copy of the state as it is now), none to disk."""
    checkpoint_engine = engine.checkpoint_engine
    original = checkpoint_engine.save

    def save(state_dict, path, *args, **kwargs):
        snapshot.add(path, state_dict, getattr(checkpoint_engine, "zipfile_serialization", True))
        return None

    checkpoint_engine.save = save
    try:
        yield snapshot
    finally:
        checkpoint_engine.save = original
