"""Saving and verifying checkpoints from the training job (every rank calls these)."""

from pathlib import Path

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
import torch

from hybrid3d.checkpoint.commit import (
    archives_to_check,
    commit,
    corrupted_archive,
    prepare_staging,
    staging_tag,
)
from hybrid3d.checkpoint.files import prune_checkpoints, tag_for_step
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
    """Saves through the commit protocol of checkpoint/commit.py; never saves non-finite weights."""

    def __init__(self, trainer, save_dir: Path, meta: dict, keep_last: int, is_rank0: bool):
        self.trainer = trainer
        self.save_dir = save_dir
        self.meta = meta
        self.keep_last = keep_last
        self.is_rank0 = is_rank0

    def save(self, step: int, rng: dict, samples: int) -> Path:
        """Save after `step` optimizer steps that consumed `samples` samples (`data.DataCursor`)."""
        if not weights_are_finite(self.trainer.module):
            raise NonFiniteError(f"weights hold NaN or inf at step {step}; not saving a checkpoint")
        tag = tag_for_step(step)
        if self.is_rank0:
            prepare_staging(self.save_dir, tag, at_step(self.meta, step, samples))
        dist.barrier()
        mine = self.trainer.save(str(self.save_dir), tag=staging_tag(tag), save_latest=False,
                                 client_state=training_client_state(step, samples, rng))
        written = [None] * dist.get_world_size()
        dist.all_gather_object(written, mine)  # also the barrier: every rank's files are on disk before the commit
        if self.is_rank0:
            commit(self.save_dir, tag, {path: size for files in written for path, size in files.items()})
            prune_checkpoints(self.save_dir, self.keep_last, step)
        dist.barrier()
        return self.save_dir / tag


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
