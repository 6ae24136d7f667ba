"""Intra-op threads per rank, on every accelerator (a GPU rank's host-side work runs on the CPU too).

torch starts each process with as many intra-op threads as the machine has cores, and DeepSpeed's
launcher leaves that alone (only `--bind_cores_to_rank` sets OMP_NUM_THREADS). With n ranks on one
host that is n x cores compute threads fighting over the cores: measured here, the CPU demo (TP2 x PP2,
4 ranks on 2 cores) ran at 630 tokens/s with the default and 3,788 with one thread per rank. So each
rank takes its share of the cores it may run on, unless the user chose a number (OMP_NUM_THREADS).
torchrun does the same for GPU jobs (OMP_NUM_THREADS=1 when it starts more than one process per node).
"""

import os

import torch


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def local_ranks() -> int:
    """Ranks on this host, as DeepSpeed's launcher (LOCAL_SIZE) or torchrun (LOCAL_WORLD_SIZE) says."""
    return int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)


def local_rank(default: int = 0) -> int:
    """This rank's index on its host (LOCAL_RANK, which both launchers set); `default` where none is set."""
    return int(os.environ.get("LOCAL_RANK", default))


def threads_per_rank(local_ranks: int, cores: int) -> int:
    """An equal share of `cores` for each of `local_ranks` ranks on this host, at least one."""
    return max(1, cores // max(1, local_ranks))


def set_cpu_threads(local_ranks: int) -> str:
    """Set torch's intra-op threads for one of `local_ranks` CPU ranks on this host; return a line
    saying what was chosen and why. OMP_NUM_THREADS, when set, wins (torch has already read it)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return f"CPU threads per rank: {torch.get_num_threads()} (OMP_NUM_THREADS)"
    cores = usable_cores()
    threads = threads_per_rank(local_ranks, cores)
    torch.set_num_threads(threads)
    return (f"CPU threads per rank: {threads} ({cores} cores / {local_ranks} ranks on this host; "
            "OMP_NUM_THREADS overrides)")
