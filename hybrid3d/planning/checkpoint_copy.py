"""Host memory an asynchronous save holds (`hybrid3d.checkpoint.async`, checkpoint/async_save.py): each rank's copy
of its checkpoint files' states (checkpoint/host_copy.py), from the first save to the end of the run (the buffers
are reused by every save).

A rank's files are DeepSpeed's: the module weights of its stages (a pipeline's layer files and the plain engine's
model file are written by data-parallel rank 0 of each model-parallel group, in the weights' dtype, lp bytes an
element) and its optimizer state (each DP rank its ZeRO partition: the fp32 master and Adam's two moments, 12 bytes
an element over the nd ranks that share them; without ZeRO data-parallel rank 0 writes all of it, and fp32 weights
stepped by torch's AdamW have no separate master: 8 bytes). ZeRO-3's files hold every rank's partitions of both (lp
weights and 12 bytes over nd). Data-parallel rank 0 holds the most. The RNG states (a few kB) are left out. LoRA
runs save the adapters and their optimizer state only, far less: counted here as a full fine-tune (an upper bound).
"""

from hybrid3d.model.config import LlamaShape
from hybrid3d.planning.memory import compute_bytes
from hybrid3d.planning.parameters import rank_parameter_numels


def rank_copy_bytes(shape: LlamaShape, tp: int, pp: int, rank: int, nd: int, zero: int, precision: str,
                    schedule: str = "1f1b", v: int = 1) -> int:
    """Bytes data-parallel rank 0 of pipeline rank `rank` copies at a save (module docstring)."""
    numel = sum(rank_parameter_numels(shape, tp, pp, rank, schedule, v))
    weights = compute_bytes(precision) * numel
    if zero == 3:
        return (weights + 12 * numel) // nd
    optimizer = (8 if zero == 0 and precision == "fp32" else 12) * numel
    return weights + (optimizer // nd if zero >= 1 else optimizer)


def async_copy_bytes(shape: LlamaShape, tp: int, pp: int, nd: int, zero: int, precision: str,
                     schedule: str = "1f1b", v: int = 1) -> int:
    """The most any rank holds: the largest pipeline rank's `rank_copy_bytes`."""
    return max(rank_copy_bytes(shape, tp, pp, r, nd, zero, precision, schedule, v) for r in range(pp))
