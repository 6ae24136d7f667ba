"""All-or-nothing output folders, and the non-weight files (config, tokenizer) carried across.

A conversion writes into a hidden folder next to `--out` and renames it into place only when
everything is written, so a failure (bad input found late, a full disk, Ctrl-C) leaves no
partial checkpoint that a later run could mistake for a good one.
"""

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from hybrid3d.errors import ConversionError

# Weight and index files a model folder may hold; everything else (config.json,
# generation_config.json, tokenizer files, README) is metadata worth keeping.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")


def check_output_free(out_dir: Path) -> None:
    if out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir())):
        raise ConversionError(f"{out_dir}: already exists and is not an empty folder")


@contextlib.contextmanager
def staging_dir(out_dir):
    """Yield a fresh folder beside `out_dir`; on success it becomes `out_dir`, on any error it
    and any parent folders this created are removed."""
    out_dir = Path(out_dir).absolute()
    check_output_free(out_dir)
    created = [p for p in reversed(out_dir.parents) if not p.exists()]
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    staging.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the result should be an ordinary folder
    try:
        yield staging
        check_output_free(out_dir)
        if out_dir.exists():
            out_dir.rmdir()
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for parent in reversed(created):
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def metadata_files(directory: Path) -> list[Path]:
    """Top-level files of an HF folder that are not weights (subfolders are not copied)."""
    return sorted(p for p in Path(directory).iterdir()
                  if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES) and not p.name.startswith("."))


def copy_metadata_files(source: Path, target: Path, skip=()) -> list[str]:
    target.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in metadata_files(source):
        if path.name not in skip:
            shutil.copy2(path, target / path.name)
            copied.append(path.name)
    return copied
