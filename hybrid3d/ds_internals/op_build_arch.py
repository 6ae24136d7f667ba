"""TORCH_CUDA_ARCH_LIST spelled so that DeepSpeed 0.19.8's JIT op builder can read it.

Torch accepts arch-specific targets such as `9.0a` (sm_90a, Hopper's wgmma/TMA instructions) in
TORCH_CUDA_ARCH_LIST, and CUDA images for Hopper set it that way. DeepSpeed's `CUDAOpBuilder.compute_capability_args`
sorts the list with `int()` of each dotted part, so `9.0a` raises `ValueError: invalid literal for int() with base
10: '0a'` when FusedAdam (the default Adam on a GPU) is first built: the first training step on such a machine
never starts. Measured on the lent H200 (its environment sets the list): `tests/gpu`'s launcher test failed there.

The ops DeepSpeed JIT-builds for training (fused Adam, LAMB) use no arch-specific instructions, so the plain
targets (`9.0`, keeping `+PTX`) build the same kernels for the same devices.
"""

import os
import re

ARCH_LIST_VARIABLE = "TORCH_CUDA_ARCH_LIST"
# "9.0a", "10.0f+PTX": a major.minor target with a family/arch-specific letter suffix DeepSpeed cannot parse
_LETTER_SUFFIXED = re.compile(r"^(\d+)\.(\d+)[A-Za-z]+(\+PTX)?$")


def deepspeed_readable_arch_list(value: str) -> str:
    """`value` with each `M.ma` / `M.ma+PTX` entry written `M.m` / `M.m+PTX` (order, separators and
    everything else kept)."""
    return re.sub(r"[^;\s]+", lambda entry: _LETTER_SUFFIXED.sub(r"\1.\2\3", entry.group(0)), value)


def make_arch_list_readable_for_op_builds() -> str | None:
    """Rewrite TORCH_CUDA_ARCH_LIST in this process's environment (DeepSpeed reads it from there at build time)
    when DeepSpeed could not parse it; returns the line to log, or None when nothing changed."""
    value = os.environ.get(ARCH_LIST_VARIABLE)
    if not value:
        return None
    readable = deepspeed_readable_arch_list(value)
    if readable == value:
        return None
    os.environ[ARCH_LIST_VARIABLE] = readable
    return (f"{ARCH_LIST_VARIABLE}={value!r} read as {readable!r} for DeepSpeed's op builds "
            f"(deepspeed 0.19.8 cannot parse arch-specific suffixes)")
