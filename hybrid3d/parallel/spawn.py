"""Run a function on N ranks spawned on this machine (tests and benchmarks).

Each rank gets the environment DeepSpeed's launcher would set, initialises `deepspeed.comm`
(gloo on the CPU, NCCL with DS_ACCELERATOR=cuda), runs `fn(rank, world_size, *args)` and saves
its return value, which `run_world` hands back. The world's shared-memory segments are removed
when it ends.
"""

import os
import socket

import torch
import torch.multiprocessing as mp

from hybrid3d.ds_internals.shm_buffers import remove_shm_buffers
from hybrid3d.parallel.threads import threads_per_rank, usable_cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank, fn, world_size, port, result_dir, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(threads_per_rank(world_size, usable_cores()))
    import deepspeed
    import deepspeed.comm as dist

    from deepspeed.accelerator import get_accelerator

    backend = "nccl" if os.environ["DS_ACCELERATOR"] == "cuda" else "gloo"
    if backend == "nccl":
        get_accelerator().set_device(rank)  # one GPU per rank, before any communicator exists
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    result = fn(rank, world_size, *args)
    torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def run_world(fn, world_size: int, result_dir: str, *args) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned ranks; return each rank's result.

    `fn` must be importable by name (spawned processes re-import it)."""
    os.makedirs(result_dir, exist_ok=True)
    port = free_port()
    try:
        mp.start_processes(_rank_entry, args=(fn, world_size, port, result_dir, args), nprocs=world_size,
                           start_method="spawn", join=True)
    finally:
        remove_shm_buffers("127.0.0.1", port)
    # The results are this run's own objects (dicts of tensors and plain data).
    return [torch.load(os.path.join(result_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
