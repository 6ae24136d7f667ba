"""Asynchronous saves (`hybrid3d.checkpoint.async`): the step is held only while each rank copies its states; a
background thread writes the files; the commit of checkpoint/commit.py follows once every rank's files are durable.

At a save each rank copies the state of every file DeepSpeed's engine would write to host memory
(`ds_internals.durable_save.snapshot_saves` into a `host_copy.Snapshot`: pinned buffers for states on an
accelerator) and hands the copies to a `BackgroundWriter`, which `torch.save`s them to their paths and fsyncs them,
in order, while training goes on: the files are the synchronous save's, byte for byte for states on the host. A
thread rather than a process writes, as the copies are in this process: `torch.save` to a path leaves the GIL to
the training thread while it writes the storages. By default the thread runs at Linux's idle scheduling policy
(`async_writer: "idle"`, SCHED_IDLE), so it takes only CPU time no training thread wants: measured on 2 cores with six
ranks, a normal-priority writer slowed the steps after the save by the CPU it took (benchmarks/async_checkpoint.py).
The ranks learn together whether every writer is done: at each step boundary (every rank calls `poll` at the same
step) one all-reduce of a flag; when all are done, their {path: bytes} lists are gathered and rank 0 commits
(manifest, rename, `latest`, pruning) exactly as a synchronous save does. Until then the tag is `<tag>.incomplete`,
which no resume loads: a crash during the write leaves the previous `latest`. At most one save is in flight: the next
save, the end of training, a stop (SIGTERM, Ctrl-C) and a non-finite stop first wait for it and commit it.
"""

import os
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from hybrid3d.ds_internals.durable_save import fsync_dir, fsync_file


def lower_to_idle_priority() -> bool:
    """The calling thread to SCHED_IDLE (Linux applies scheduling policies per thread); False where the platform has
    no such policy or refuses it (the thread then keeps its priority)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return os.sched_getscheduler(0) == os.SCHED_IDLE
    except (AttributeError, OSError):
        return False


class BackgroundWriter:
    """Writes {path: (state, zipfile)} (`host_copy.Snapshot.files`) to disk with `torch.save` on a thread of its
    own, each file fsync'ed (and its folder), in order; `idle`: at the idle scheduling policy."""

    def __init__(self, files: dict, idle: bool = True):
        self._files = files
        self._idle = idle
        self.at_idle_priority = False  # whether the thread ran at SCHED_IDLE
        self.written: dict = {}  # path -> bytes on disk, as each file is done
        self.error: Optional[BaseException] = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._write, name="hybrid3d-checkpoint-writer", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        started = time.perf_counter()
        if self._idle:
            self.at_idle_priority = lower_to_idle_priority()
        try:
            folders = set()
            for path, (state, zipfile) in self._files.items():
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                torch.save(state, path, _use_new_zipfile_serialization=zipfile)
                self.written[path] = fsync_file(path)
                folders.add(os.path.dirname(path))
            for folder in folders:
                fsync_dir(folder)
        except BaseException as e:  # noqa: BLE001 - re-raised in the training thread by `wait`
            self.error = e
        finally:
            self._files = {}  # the copies' buffers stay with the rank's HostBuffers for the next save
            self.seconds = time.perf_counter() - started

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> dict:
        """Block until every file is written; {path: bytes}, or the writer's error raised here."""
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.written


class InFlight:
    """The save being written: its tag and step, the writer, and how long the step was held for the copy."""

    def __init__(self, tag: str, step: int, writer: BackgroundWriter, held_seconds: float, copied_bytes: int):
        self.tag, self.step, self.writer = tag, step, writer
        self.held_seconds, self.copied_bytes = held_seconds, copied_bytes
