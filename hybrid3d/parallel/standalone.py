"""A plain `python launch/train.py` (or `python -m hybrid3d.verify`): one process, a world of size 1.

Without the launcher's variables `deepspeed.init_distributed` falls into MPI discovery (and fails without
mpi4py); a single process gets them here instead. A layout that needs more ranks says how to launch it.
"""

import os
import socket

# What DeepSpeed's launcher sets for each rank; init_distributed looks for MPI when any is missing.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched() -> bool:
    """Whether a launcher (DeepSpeed's, torchrun, a test's spawner) started this process."""
    return any(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def use_single_process_world() -> None:
    """Set the launcher's variables for a world of one rank (a free local port) unless a launcher set them."""
    if launched():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def launch_hint(ranks: int, what: str, command: str) -> str:
    """The one line for a layout of `ranks` ranks run as a single process."""
    return (f"{what} needs {ranks} ranks and this is a single process: launch with "
            f"`deepspeed --num_gpus {ranks} {command}` (a multiple of {ranks} adds data parallelism)")
