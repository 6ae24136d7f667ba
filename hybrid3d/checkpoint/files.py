"""The files of a hybrid3d checkpoint beside DeepSpeed's own: tag names, the per-tag hybrid3d.json (its contents:
schema.py), the HF config folder, pruning of old tags."""

import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional

from hybrid3d.ds_internals.durable_save import fsync_file

META_FILE = "hybrid3d.json"  # per tag: layout, step, model config; readable without unpickling
HF_FILES_DIR = "hf"  # per save_dir: the HF config and tokenizer, for export back to HF
TAG_PREFIX = "global_step"


def tag_for_step(step: int) -> str:
    return f"{TAG_PREFIX}{step}"


def write_meta(tag_dir: Path, meta: dict) -> None:
    """Replace the tag's hybrid3d.json atomically and durably (written, fsync'ed, renamed)."""
    tmp = tag_dir / f".{META_FILE}.tmp"
    tmp.write_text(json.dumps(meta, indent=1, default=str))
    fsync_file(tmp)
    os.replace(tmp, tag_dir / META_FILE)


def read_meta(tag_dir: Path) -> Optional[dict]:
    path = tag_dir / META_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def prune_checkpoints(save_dir: Path, keep_last: int, saved_step: int) -> list[str]:
    """After committing the tag of `saved_step`: remove all but the newest `keep_last` tags of steps up to it
    (and their universal twins). Tags of later steps belong to another branch of history (a run resumed from an
    earlier tag): they are left alone, so the tag just saved, which `latest` names, is always kept."""
    if keep_last <= 0:
        return []
    steps = sorted(step for p in save_dir.iterdir()
                   if p.is_dir() and (m := re.fullmatch(rf"{TAG_PREFIX}(\d+)", p.name))
                   and (step := int(m.group(1))) <= saved_step)
    removed = []
    for step in steps[:-keep_last]:
        for name in (tag_for_step(step), f"{tag_for_step(step)}_universal"):
            if (save_dir / name).exists():
                shutil.rmtree(save_dir / name)
                removed.append(name)
    return removed
