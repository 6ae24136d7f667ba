"""Crash-safe checkpoint commits and integrity checks.

Commit protocol: every rank saves DeepSpeed's files into `<save_dir>/<tag>.incomplete` (DeepSpeed's
own `latest` is not written) and fsyncs them; after a barrier rank 0 checks every rank's files in its own
view, records a manifest (file -> bytes) in the tag's hybrid3d.json, renames the folder to `<tag>` (atomic
on POSIX file systems) and replaces `latest` atomically, each step fsync'ed before the next. A crash at any
point leaves `latest` naming the previous complete tag; an `.incomplete` folder is never loaded and is
removed by the next save of that step.

At load the manifest catches missing and truncated files before DeepSpeed opens anything, and
the ranks CRC-check every `.pt` archive (torch.save writes zip files with a CRC-32 per member),
each rank a share of the files, so a corrupted shard is named instead of half-loaded.
"""

import os
import shutil
import zipfile
from pathlib import Path
from typing import Optional

from hybrid3d.checkpoint.files import META_FILE, read_meta, write_meta
from hybrid3d.checkpoint.schema import MANIFEST_KEY, manifest
from hybrid3d.ds_internals.durable_save import fsync_dir, fsync_file
from hybrid3d.errors import CheckpointError

INCOMPLETE_SUFFIX = ".incomplete"


def staging_tag(tag: str) -> str:
    return f"{tag}{INCOMPLETE_SUFFIX}"


def prepare_staging(save_dir: Path, tag: str, meta: dict) -> None:
    """Rank 0, before the ranks save: a clean staging folder holding the tag's metadata."""
    staging = save_dir / staging_tag(tag)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    write_meta(staging, meta)


def commit(save_dir: Path, tag: str, written: Optional[dict] = None) -> Path:
    """Rank 0, after every rank saved and fsync'ed its files: check them, manifest, rename into place, `latest`.

    `written` ({path: bytes} of every rank, `ds_internals.durable_save.record_saves`): each file must be in rank
    0's view with the size its writer saw, else CheckpointError (a file system that shows other nodes' writes late
    would otherwise commit a tag missing them). Each step is made durable before the next: the manifest, the
    folder's entries, the rename (in save_dir), `latest`."""
    staging, final = save_dir / staging_tag(tag), save_dir / tag
    for path, size in sorted((written or {}).items()):
        seen = Path(path).stat().st_size if Path(path).is_file() else None
        if seen != size:
            raise CheckpointError(f"{path}: written with {size} bytes but rank 0 sees "
                                  f"{'no file' if seen is None else f'{seen} bytes'}; not committing {tag} "
                                  "(save_dir must be one file system every node sees alike, docs/reliability.md)")
    meta = read_meta(staging) or {}
    meta[MANIFEST_KEY] = {str(p.relative_to(staging)): p.stat().st_size
                          for p in sorted(staging.rglob("*")) if p.is_file() and p.name != META_FILE}
    write_meta(staging, meta)
    fsync_dir(staging)
    if final.exists():  # the same step saved again (e.g. a resumed run stopping where it started)
        shutil.rmtree(final)
    os.replace(staging, final)
    fsync_dir(save_dir)
    latest_tmp = save_dir / ".latest.tmp"
    latest_tmp.write_text(tag)
    fsync_file(latest_tmp)
    os.replace(latest_tmp, save_dir / "latest")
    fsync_dir(save_dir)
    return final


def corrupted_archive(paths) -> Optional[str]:
    """The first .pt file whose zip structure or CRC-32 check fails, with the reason; else None."""
    for path in paths:
        try:
            with zipfile.ZipFile(path) as archive:
                bad_member = archive.testzip()
        except (zipfile.BadZipFile, OSError) as e:
            return f"{path}: {e}"
        if bad_member is not None:
            return f"{path}: member {bad_member} fails its CRC check"
    return None


def archives_to_check(tag_dir: Path, meta: dict) -> list[Path]:
    return [tag_dir / name for name in sorted(manifest(meta)) if name.endswith(".pt")]
