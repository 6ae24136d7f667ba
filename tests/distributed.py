"""Run a function on N gloo ranks (spawned processes) and hand rank results back to the test.

Spawning a world costs seconds on 2 cores (imports dominate), so each world runs many checks
and returns their raw results; assertions then happen in the pytest process.
"""

import os
import socket

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank, fn, world_size, port, result_dir, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm as dist

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    result = fn(rank, world_size, *args)
    torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def run_world(fn, world_size: int, result_dir: str, *args) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return each rank's return value."""
    os.makedirs(result_dir, exist_ok=True)
    mp.start_processes(_rank_entry, args=(fn, world_size, free_port(), result_dir, args), nprocs=world_size,
                       start_method="spawn", join=True)
    return [torch.load(os.path.join(result_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
