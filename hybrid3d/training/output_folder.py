"""A run's output folder: what an earlier run left there, and train.overwrite.

A new run into a previous run's folders would append to its metrics.jsonl and mix its checkpoints with the
old tags (a tag of the same step replaced, keep_last counting the old tags among its newest)."""

import shutil
from pathlib import Path

from hybrid3d.checkpoint.files import TAG_PREFIX
from hybrid3d.config.sections import HybridSection
from hybrid3d.errors import ConfigError


def output_folders(hybrid: HybridSection) -> tuple[Path, Path]:
    """(train.output_dir, the checkpoint folder); an output_dir that exists as a file is refused."""
    output_dir = Path(hybrid.train.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"hybrid3d.train.output_dir: {output_dir} exists and is not a folder")
    return output_dir, Path(hybrid.checkpoint_dir)


def previous_run(output_dir: Path, save_dir: Path) -> str | None:
    """What in these folders belongs to an earlier run (its metrics, its checkpoints), or None."""
    if (output_dir / "metrics.jsonl").is_file():
        return str(output_dir / "metrics.jsonl")
    if (save_dir / "latest").is_file():
        return str(save_dir / "latest")
    tags = sorted(save_dir.glob(f"{TAG_PREFIX}*")) if save_dir.is_dir() else []
    return str(tags[0]) if tags else None


def clear_previous_run(output_dir: Path, save_dir: Path) -> str:
    """Remove what `previous_run` finds (train.overwrite); return what was removed, in words."""
    removed = []
    if (output_dir / "metrics.jsonl").is_file():
        (output_dir / "metrics.jsonl").unlink()
        removed.append("metrics.jsonl")
    tags = sorted(save_dir.glob(f"{TAG_PREFIX}*")) if save_dir.is_dir() else []
    for tag in tags:
        shutil.rmtree(tag) if tag.is_dir() else tag.unlink()
    if (save_dir / "latest").is_file():
        (save_dir / "latest").unlink()
    if tags:
        removed.append(f"{len(tags)} checkpoint folders in {save_dir}")
    return " and ".join(removed) or "nothing"


def resumes(plan, save_dir: Path) -> bool:
    return plan is not None and plan.load_dir.resolve() == save_dir.resolve()


def check_output_folder(output_dir: Path, save_dir: Path, plan, overwrite: bool) -> bool:
    """A new run into a previous run's folders would append to its metrics.jsonl and mix its checkpoints
    with the old tags (keep_last could then prune the tag just written): refused, unless this run resumes
    that run (checkpoint.load is its save_dir) or train.overwrite asks to start over. True: start over (the
    job removes the previous run's files once it has started, `clear_previous_run`)."""
    found = previous_run(output_dir, save_dir)
    if found is None or resumes(plan, save_dir):
        return False
    if overwrite:
        return True
    raise ConfigError(f"hybrid3d.train.output_dir: {output_dir} holds a previous run ({found}): resume it with "
                      "--checkpoint.load latest, start over with --train.overwrite true, or choose another "
                      "--train.output_dir")
