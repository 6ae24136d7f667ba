"""Cleanup of DeepSpeed's CPU shared-memory collective buffers.

On the CPU accelerator DeepSpeed's `deepspeed_shm_comm` op creates one `/dev/shm` segment per rank
and world (`deepspeed_allreduce_buffer_<uid>_<master addr>_<master port>_<rank>`, about 69 MB, see
`ops/csrc/cpu/comm/shm.cpp`) and never unlinks it, so every finished run would leave them behind
until the tmpfs fills. Each rank removes its own segment when its world is done.
"""

import glob
import os

SHM_DIR = "/dev/shm"
PREFIX = "deepspeed_allreduce_buffer"


def remove_shm_buffers(master_addr: str, master_port, rank=None) -> int:
    """Unlink this world's segments (one rank's, or all with `rank=None`); returns how many."""
    pattern = f"{PREFIX}_*_{master_addr}_{master_port}_{'*' if rank is None else rank}"
    removed = 0
    for path in glob.glob(os.path.join(SHM_DIR, pattern)):
        try:
            os.remove(path)  # safe while mapped: the pages go when the last mapping does
            removed += 1
        except OSError:
            pass
    return removed
