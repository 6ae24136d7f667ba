"""What DeepSpeed's universal-checkpoint tools need to know about hybrid3d's parameters, and the
conversion of a tag to a universal checkpoint (resharding to another TP/PP/DP layout).

`ds_to_universal` merges TP shards by name pattern; these patterns come from the same table
(`param_specs`) that slices HF weights, so conversion, training and resharding agree.
"""

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from deepspeed.checkpoint import constants as uc

from hybrid3d.checkpoint.files import META_FILE
from hybrid3d.ds_internals.universal_convert import run_ds_to_universal
from hybrid3d.model.config import LlamaShape
from hybrid3d.model.hf_weights import param_specs
from hybrid3d.model.tp_plan import REPLICATED, ROW, VOCAB
from hybrid3d.parallel.tensor_parallel import padded_vocab_size


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


UNIVERSAL_MARKER = "hybrid3d_universal.json"  # written last: the conversion finished, and from which source


def universal_source_id(tag_dir: Path) -> str:
    """What identifies the converted tag: the sha256 of its hybrid3d.json (step, samples, manifest of sizes), so
    a `<tag>_universal` left by another branch of history that reused the tag name is not taken for this one."""
    meta = tag_dir / META_FILE
    return hashlib.sha256(meta.read_bytes()).hexdigest() if meta.is_file() else f"no {META_FILE}"


def convert_to_universal(plan, into: Path | None = None) -> Path:
    """Run DeepSpeed's `ds_to_universal` on the tag, once: the result is kept next to it as `<tag>_universal`.
    `plan` is a `hybrid3d.checkpoint.resume.ResumePlan`.

    The conversion writes into `<tag>_universal.incomplete` and is renamed into place only after its marker (the
    source's `universal_source_id`) is written, so a killed conversion is never reused; an existing
    `<tag>_universal` whose marker does not name this tag's contents is removed and converted again. `into`: another
    folder for it (an evaluation writes nothing into the checkpoint folder: `scratch_folder`); every rank of a
    node may convert there at once (another node's temporary folder is not shared), so each stages in its own
    folder and the first one renamed into place wins."""
    source = plan.load_dir / plan.tag
    output = (into or plan.load_dir) / plan.universal_tag
    wanted = universal_source_id(source)
    marker = output / UNIVERSAL_MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("source") == wanted:
        return output
    staging = output.with_name(output.name + (f".incomplete-{os.getpid()}" if into else ".incomplete"))
    for stale in (output, staging):
        if stale.exists():
            shutil.rmtree(stale)
    staging.parent.mkdir(parents=True, exist_ok=True)
    run_ds_to_universal(source, staging)
    (staging / UNIVERSAL_MARKER).write_text(json.dumps({"source": wanted, "tag": plan.tag}))
    try:
        os.replace(staging, output)
    except OSError:  # another rank of this node renamed its conversion into place first
        if not (marker.is_file() and json.loads(marker.read_text()).get("source") == wanted):
            raise
        shutil.rmtree(staging)
    return output


def scratch_folder(plan) -> Path:
    """A folder outside the checkpoint for an evaluation's universal conversion (this node's temporary folder),
    named by the source tag's path and contents so every rank of the node finds the same one."""
    import tempfile

    source = plan.load_dir / plan.tag
    key = hashlib.sha256(f"{source.resolve()}:{universal_source_id(source)}".encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"hybrid3d-eval-{key}"
