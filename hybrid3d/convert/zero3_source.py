"""The weights of one TP rank of a ZeRO-3 checkpoint, consolidated by DeepSpeed's own zero_to_fp32.

ZeRO-3 keeps no whole weight in any file: each data-parallel rank's optimizer file holds its fp32 partitions, in the
order of `param_shapes`. `deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint` merges them, but it
reads every `*_model_states.pt` / `*_optim_states.pt` of a tag folder as one model-parallel rank's; so each TP rank is
read through a folder of links to that rank's files only. The whole fp32 state of the rank is in memory while it is
exported (DeepSpeed's reader loads the optimizer files whole); the checkpoint's compute dtype (bf16 or fp32) is what
the export casts to, which equals the trained weights bit for bit (DeepSpeed derives them from these fp32 masters).
"""

import contextlib
import io
import tempfile
from pathlib import Path

import torch

from hybrid3d.errors import ConversionError


def consolidated_tp_rank(tag_dir: Path, mp_rank: int, exclude_frozen: bool) -> dict[str, torch.Tensor]:
    """{`<global layer index>.<name>`: fp32 tensor} of model-parallel rank `mp_rank` (stage * tp + tp rank);
    `exclude_frozen`: a LoRA checkpoint, whose optimizer files hold the adapters only."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    files = sorted(tag_dir.glob(f"zero_pp_rank_*_mp_rank_{mp_rank:02d}_*_states.pt"))
    if not any(f.name.endswith("_optim_states.pt") for f in files):
        raise ConversionError(f"{tag_dir}: no zero_pp_rank_*_mp_rank_{mp_rank:02d}_optim_states.pt (a ZeRO-3 "
                              "checkpoint keeps its weights in the optimizer files)")
    with tempfile.TemporaryDirectory(prefix="hybrid3d-zero3-") as scratch:
        rank_dir = Path(scratch) / tag_dir.name
        rank_dir.mkdir()
        for f in files:
            (rank_dir / f.name).symlink_to(f.resolve())
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # its progress lines, not the converter's
                return get_fp32_state_dict_from_zero_checkpoint(scratch, tag=tag_dir.name,
                                                                exclude_frozen_parameters=exclude_frozen)
        except (RuntimeError, ValueError, KeyError, OSError) as e:
            raise ConversionError(f"{tag_dir}: DeepSpeed's zero_to_fp32 could not read model-parallel rank "
                                  f"{mp_rank}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
