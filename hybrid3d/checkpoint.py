"""What DeepSpeed's universal-checkpoint tools need to know about hybrid3d's parameters.

`ds_to_universal` merges TP shards by name pattern; these patterns come from the same table
(`param_specs`) that slices HF weights, so conversion, training and resharding agree.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from deepspeed.checkpoint import constants as uc

from hybrid3d.config import ConfigError
from hybrid3d.model.config import LlamaShape
from hybrid3d.model.hf_weights import REPLICATED, ROW, VOCAB, param_specs
from hybrid3d.tensor_parallel import padded_vocab_size


def _exact(names) -> list[str]:
    return [f"^{re.escape(name)}$" for name in sorted(set(names))]


def universal_checkpoint_info(shape: LlamaShape, tp_size: int) -> dict:
    """The `universal_checkpoint_info` client state for a model split over `tp_size` ranks."""
    specs = param_specs(shape, tp_size)
    return {
        uc.UNIVERSAL_CHECKPOINT_VERSION_KEY: uc.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        uc.TP_REPLICATED_PARAMETER_PATTERNS: _exact(s.local_name for s in specs if s.kind == REPLICATED),
        uc.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: _exact(s.local_name for s in specs if s.kind == ROW),
        uc.VOCABULARY_PARAMETER_PATTERNS: _exact(s.local_name for s in specs if s.kind == VOCAB),
        uc.ORIGINAL_VOCAB_SIZE: shape.vocab_size,
        uc.PADDED_VOCAB_SIZE: padded_vocab_size(shape.vocab_size, tp_size, shape.vocab_pad_multiple),
    }


# --- Saving, finding and resuming checkpoints -------------------------------------------------

META_FILE = "hybrid3d.json"  # per tag: layout, step, model config; readable without unpickling
HF_FILES_DIR = "hf"  # per save_dir: the HF config and tokenizer, for export back to HF
TAG_PREFIX = "global_step"
MANIFEST_KEY = "files"  # in hybrid3d.json: file -> bytes, written when the tag is committed


def tag_for_step(step: int) -> str:
    return f"{TAG_PREFIX}{step}"


def write_meta(tag_dir: Path, meta: dict) -> None:
    tmp = tag_dir / f".{META_FILE}.tmp"
    tmp.write_text(json.dumps(meta, indent=1, default=str))
    os.replace(tmp, tag_dir / META_FILE)


def read_meta(tag_dir: Path) -> Optional[dict]:
    path = tag_dir / META_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def prune_checkpoints(save_dir: Path, keep_last: int) -> list[str]:
    """Remove all but the newest `keep_last` step tags (and their universal twins)."""
    if keep_last <= 0:
        return []
    steps = sorted(int(m.group(1)) for p in save_dir.iterdir()
                   if p.is_dir() and (m := re.fullmatch(rf"{TAG_PREFIX}(\d+)", p.name)))
    removed = []
    for step in steps[:-keep_last]:
        for name in (tag_for_step(step), f"{tag_for_step(step)}_universal"):
            if (save_dir / name).exists():
                shutil.rmtree(save_dir / name)
                removed.append(name)
    return removed


@dataclass
class ResumePlan:
    """What `checkpoint.load` points at and how to load it into the current layout."""

    load_dir: Path  # the folder holding `latest` and the tag folders
    tag: str
    meta: dict  # contents of the tag's hybrid3d.json
    module_only: bool  # weights only (a converted HF model): fresh optimizer, step 0
    universal: bool  # the layout differs: reshard through DeepSpeed's universal checkpoint

    @property
    def universal_tag(self) -> str:
        return f"{self.tag}_universal"


def find_checkpoint(load: str, save_dir: Optional[str]) -> tuple[Path, str]:
    """Resolve `checkpoint.load` ('latest', a save_dir with a `latest` file, or a tag folder)."""
    key = "hybrid3d.checkpoint.load"
    if load == "latest":
        if not save_dir:
            raise ConfigError(f"{key}=latest needs hybrid3d.checkpoint.save_dir")
        folder = Path(save_dir)
    else:
        folder = Path(load)
    if not folder.is_dir():
        raise ConfigError(f"{key}: {folder} is not a folder")
    latest = folder / "latest"
    if latest.is_file():
        tag = latest.read_text().strip()
        if not (folder / tag).is_dir():
            raise ConfigError(f"{key}: {latest} names tag {tag!r}, but {folder / tag} does not exist")
        return folder, tag
    if (folder / META_FILE).is_file():  # a tag folder itself
        return folder.parent, folder.name
    raise ConfigError(f"{key}: {folder} has neither a 'latest' file nor a {META_FILE} (not a hybrid3d checkpoint)")


def check_manifest(tag_dir: Path, meta: dict) -> None:
    """Missing or truncated files (per the manifest written at commit) -> ConfigError naming the file."""
    for name, size in (meta.get(MANIFEST_KEY) or {}).items():
        path = tag_dir / name
        if not path.is_file():
            raise ConfigError(f"hybrid3d.checkpoint.load: {path} is missing (the checkpoint is incomplete)")
        actual = path.stat().st_size
        if actual != size:
            raise ConfigError(f"hybrid3d.checkpoint.load: {path} has {actual} bytes, the manifest says {size} "
                              "(truncated or overwritten)")


def plan_resume(load: str, save_dir: Optional[str], tp: int, pp: int, dp: int, shape_dict: dict) -> ResumePlan:
    """Check the checkpoint against the model and decide native vs universal loading."""
    load_dir, tag = find_checkpoint(load, save_dir)
    meta = read_meta(load_dir / tag)
    if meta is None:
        raise ConfigError(f"hybrid3d.checkpoint.load: {load_dir / tag / META_FILE} is missing")
    saved_shape = meta.get("shape", {})
    differing = sorted(k for k in shape_dict if k in saved_shape and saved_shape[k] != shape_dict[k])
    if differing:
        first = differing[0]
        raise ConfigError(f"hybrid3d.checkpoint.load: {load_dir / tag} holds another model "
                          f"({first}={saved_shape[first]}, this run has {shape_dict[first]})")
    check_manifest(load_dir / tag, meta)
    saved = meta["layout"]
    module_only = bool(meta.get("module_only", False))
    if module_only and (saved["tp"], saved["pp"]) != (tp, pp):
        raise ConfigError(f"hybrid3d.checkpoint.load: {load_dir / tag} holds weights only, converted for "
                          f"tp={saved['tp']} pp={saved['pp']}; this run has tp={tp} pp={pp}: convert again "
                          f"with --tp {tp} --pp {pp}")
    universal = not module_only and (saved["tp"], saved["pp"], saved["dp"]) != (tp, pp, dp)
    return ResumePlan(load_dir=load_dir, tag=tag, meta=meta, module_only=module_only, universal=universal)


def convert_to_universal(plan: ResumePlan) -> Path:
    """Run DeepSpeed's `ds_to_universal` on the tag (once; the result is kept next to it)."""
    output = plan.load_dir / plan.universal_tag
    if not (output / "zero").is_dir():
        subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                        "--input_folder", str(plan.load_dir / plan.tag), "--output_folder", str(output),
                        "--num_extract_workers", "1", "--num_merge_workers", "1"],
                       check=True, stdout=subprocess.DEVNULL)
    return output
