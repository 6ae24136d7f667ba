"""Saving and verifying checkpoints from the training job (every rank calls these)."""

import time
from pathlib import Path
from typing import Optional

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
import torch

from hybrid3d.checkpoint.async_save import BackgroundWriter, InFlight
from hybrid3d.checkpoint.commit import (
    archives_to_check,
    commit,
    corrupted_archive,
    prepare_staging,
    staging_tag,
)
from hybrid3d.checkpoint.files import prune_checkpoints, tag_for_step
from hybrid3d.checkpoint.host_copy import HostBuffers, Snapshot
from hybrid3d.checkpoint.schema import at_step, training_client_state
from hybrid3d.ds_internals.zero3 import held
from hybrid3d.errors import CheckpointError, NonFiniteError, ReportedError


def weights_are_finite(module) -> bool:
    """All ranks agree whether every local parameter (ZeRO-3: every partition) is finite (one all-reduce)."""
    bad = torch.tensor([0], dtype=torch.int32, device=get_accelerator().current_device_name())
    for p in module.parameters():
        if not torch.isfinite(held(p).detach()).all():
            bad[0] = 1
            break
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bool(bad.item())


class CheckpointSaver:
    """Saves through the commit protocol of checkpoint/commit.py; never saves non-finite weights. `asynchronous`
    (hybrid3d.checkpoint.async): a save copies the states and returns; the files are written in the background (at
    the idle scheduling policy if `idle_writer`) and committed by a later `poll` or `finish`
    (checkpoint/async_save.py)."""

    def __init__(self, trainer, save_dir: Path, meta: dict, keep_last: int, is_rank0: bool,
                 asynchronous: bool = False, idle_writer: bool = True):
        self.trainer = trainer
        self.save_dir = save_dir
        self.meta = meta
        self.keep_last = keep_last
        self.is_rank0 = is_rank0
        self.asynchronous = asynchronous
        self.idle_writer = idle_writer
        self.in_flight: Optional[InFlight] = None
        self.host_buffers = HostBuffers() if asynchronous else None  # the copies' memory, kept from save to save
        self.waited_seconds = 0.0  # how long the last save waited for the one before it
        self.last_report: Optional[dict] = None  # the report of the save that wait committed

    def save(self, step: int, rng: dict, samples: int) -> Path:
        """Save after `step` optimizer steps that consumed `samples` samples (`data.DataCursor`); asynchronous: the
        tag's path, committed later (`poll`, `finish`)."""
        started = time.perf_counter()
        self.last_report = self.finish()  # at most one save in flight
        self.waited_seconds = time.perf_counter() - started
        if not weights_are_finite(self.trainer.module):
            raise NonFiniteError(f"weights hold NaN or inf at step {step}; not saving a checkpoint")
        tag = tag_for_step(step)
        started = time.perf_counter()
        if self.is_rank0:
            prepare_staging(self.save_dir, tag, at_step(self.meta, step, samples))
        dist.barrier()
        snapshot = Snapshot(self.host_buffers) if self.asynchronous else None
        mine = self.trainer.save(str(self.save_dir), tag=staging_tag(tag), save_latest=False,
                                 client_state=training_client_state(step, samples, rng), snapshot=snapshot)
        if self.asynchronous:  # every file of the rank is in the snapshot (expert files too), none written yet
            snapshot.wait_for_copies()
            writer = BackgroundWriter(snapshot.files, self.idle_writer)
            self.in_flight = InFlight(tag, step, writer, time.perf_counter() - started, snapshot.copied_bytes)
            return self.save_dir / tag
        self._commit(tag, step, mine)
        return self.save_dir / tag

    def _commit(self, tag: str, step: int, mine: dict, error: Optional[str] = None, seconds: float = 0.0) -> float:
        """Every rank: gather what each wrote (or why it could not), rank 0 commits and prunes; the longest of the
        ranks' `seconds` (an asynchronous save's background write)."""
        written = [None] * dist.get_world_size()
        dist.all_gather_object(written, (mine, error, seconds))  # also the barrier: every rank's files are on disk
        failed = next(((rank, e) for rank, (_, e, _) in enumerate(written) if e is not None), None)
        if failed is not None:
            message = f"checkpoint {tag}: rank {failed[0]} could not write its files ({failed[1]}); not committed"
            raise CheckpointError(message) if self.is_rank0 else ReportedError(message)
        if self.is_rank0:
            commit(self.save_dir, tag, {path: size for files, _, _ in written for path, size in files.items()})
            prune_checkpoints(self.save_dir, self.keep_last, step)
        dist.barrier()
        return max(s for _, _, s in written)

    def poll(self) -> Optional[dict]:
        """Every rank, at the same step: commit the save in flight if every rank's writer is done (one all-reduce
        while one is in flight); its report (`_report`) when committed, else None."""
        if self.in_flight is None:
            return None
        done = torch.tensor([int(self.in_flight.writer.done())], dtype=torch.int32,
                            device=get_accelerator().current_device_name())
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return self._commit_in_flight() if done.item() else None

    def finish(self) -> Optional[dict]:
        """Every rank: wait for the save in flight, if any, and commit it; its report."""
        return self._commit_in_flight() if self.in_flight is not None else None

    def _commit_in_flight(self) -> dict:
        flight, self.in_flight = self.in_flight, None
        error, mine = None, {}
        try:
            mine = flight.writer.wait()
        except OSError as e:
            error = str(e)
        write_seconds = self._commit(flight.tag, flight.step, mine, error, flight.writer.seconds)
        return {"checkpoint": flight.tag, "step": flight.step, "held_s": flight.held_seconds,
                "write_s": write_seconds, "copied_bytes": flight.copied_bytes}


def verify_archives(tag_dir: Path, meta: dict, rank: int, world_size: int) -> None:
    """CRC-check the tag's .pt files, each rank a share; any failure is raised on every rank."""
    files = archives_to_check(tag_dir, meta)
    problem = corrupted_archive(files[rank::world_size])
    problems = [None] * world_size
    dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first:
        error = CheckpointError if rank == 0 else ReportedError
        raise error(f"hybrid3d.checkpoint.load: {first} (corrupted checkpoint file)")
