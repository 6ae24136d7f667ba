"""What the planner's command line says around its table: GB read and written so that rounding hides
nothing, why a ZeRO-1 row can need more memory than ZeRO-0, and what would fit when nothing does."""

import argparse
import math
import re

# DeepSpeed refuses fp32 gradient accumulation without ZeRO (bf16 + ZeRO-0 + grad_accum_dtype fp32), so the
# planner's ZeRO-0 rows accumulate in bf16 and its ZeRO-1/2 rows in fp32 (planner.planned_precision).
ZERO_FOOTER = ("zero: ZeRO-0 rows accumulate gradients in bf16 (DeepSpeed has no fp32 accumulation without ZeRO);\n"
               "ZeRO-1/2/3 rows in fp32 (data_types.grad_accum_dtype fp32: BF16_Optimizer's full fp32 gradient "
               "buffer,\n4 bytes per parameter instead of 2), so at a small DP size a ZeRO-1 row can need more "
               "memory than ZeRO-0;\nrows with offload in bf16 (DeepSpeed's offload path accumulates on the host)")

_GB_TEXT = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*(gb|g|gib)?\s*", re.IGNORECASE)


def parse_gigabytes(text: str) -> float:
    """`--gpu-memory`: a number of GB (1e9 bytes, the planner's unit) as `80`, `80GB`, `80G` or `80GiB`."""
    match = _GB_TEXT.fullmatch(text)
    if not match or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of GB (80, 80GB or 80GiB), got {text!r}")
    value = float(match.group(1))
    return value * 2**30 / 1e9 if (match.group(2) or "").lower() == "gib" else value


def gb(value: float) -> str:
    """A GB figure with the digits that tell it from a limit: 1.03, 13.7, 112.0."""
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def room_for_states(least, budget_gb: float, reserve_gb: float) -> float:
    """GB a device has left for the model states of option `least` once its activations and the reserve are in."""
    return budget_gb - reserve_gb - least.activations_gb


def ranks_to_fit(least, ranks: int, room_gb: float) -> int:
    """About how many ranks (a power-of-two multiple of `ranks`) would shrink `least`'s model states into `room_gb`:
    they shrink about in proportion to the ranks sharing the model (more stages, TP, or ZeRO ranks)."""
    return ranks * 2 ** max(1, math.ceil(math.log2(least.states_gb / room_gb)))


def no_fit_hints(least, gpus: int, gpu_memory_gb: float, reserve_gb: float, moe: bool = False) -> list[str]:
    """When no layout fits: from the option needing the least memory (`least`, a planner Choice), what would
    change that: more GPUs (estimated), a shorter sequence, offload; checkpointing and micro-batch 1 are
    already among the options tried, so a smaller batch does not help. `moe`: a mixture of experts at the support
    table's layouts, which the table's own layouts (more ranks for the experts) would change."""
    if least is None:
        return []
    lines = [least_memory_line(least, gpu_memory_gb, reserve_gb) + ". What would fit:"]
    room = room_for_states(least, gpu_memory_gb, reserve_gb)
    if room > 0:
        lines.append(f"  - more GPUs: the model states must shrink {least.states_gb / room:.1f}x; "
                     f"try --gpus {ranks_to_fit(least, gpus, room)}")
    else:
        lines.append(f"  - a shorter --seq-length: the activations alone ({gb(least.activations_gb)} GB) leave no "
                     "room for the model states")
    if least.activations_gb > 0.2 * least.memory_gb:
        lines.append(f"  - a shorter --seq-length or context parallelism over more GPUs: activations are "
                     f"{least.activations_gb / least.memory_gb:.0%} of it")
    lines.append("  - activation checkpointing and micro-batch 1 are already among the options tried (a smaller "
                 "--global-batch saves nothing more)")
    if moe:
        lines.append("  - a mixture of experts runs at the support table's (tp, pp, ep) only, with no ZeRO-3 "
                     "(config/support.py): --untested-moe-layouts shows what the other layouts would need")
    else:
        lines.append("  - ZeRO-3 and offload to host memory are among the options tried; NVMe offload (ZeRO-Infinity's "
                     "offload_param/offload_optimizer device nvme) is not modelled here")
    return lines


def job_fit_hints(least, ranks: int, budget_gb: float, reserve_gb: float) -> list[str]:
    """When no layout fits a training job's "auto" budget: from the option needing the least memory (`least`), the
    changes that would make it fit, each named by what the job is given (config keys, the rank count), never a
    planner flag; a change that cannot help (a shorter sequence when the model states alone overflow) is left out."""
    hints = [f"hybrid3d.device_memory_gb >= {gb(least.memory_gb)}"]
    room = room_for_states(least, budget_gb, reserve_gb)
    if room > 0:
        hints.append(f"about {ranks_to_fit(least, ranks, room)} ranks "
                     f"(the model states must shrink {least.states_gb / room:.1f}x)")
    elif least.states_gb + reserve_gb < budget_gb:  # the activations alone overflow: a shorter sequence fits
        hints.append(f"a shorter hybrid3d.data.seq_length (the activations alone, {gb(least.activations_gb)} GB, "
                     f"exceed the {gb(budget_gb - reserve_gb - least.states_gb)} GB the model states leave)")
    return hints


def least_memory_line(least, budget_gb: float, reserve_gb: float) -> str:
    """The option needing the least memory, and its parts, against the budget."""
    name = f"TP{least.tp} PP{least.pp}" + (f" CP{least.cp}" if least.cp > 1 else "") + f" DP{least.dp}"
    return (f"the least memory any option needs: {gb(least.memory_gb)} GB per GPU ({name} ZeRO-{least.zero}, "
            f"micro-batch {least.micro_batch}{', checkpointing' if least.checkpointing else ''}"
            f"{', SP' if least.sp else ''}): {gb(least.states_gb)} model states + {gb(least.activations_gb)} "
            f"activations + {reserve_gb:g} reserve > {budget_gb:g}")
