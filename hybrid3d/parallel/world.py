"""Starting this process's rank of the world: the one place that calls `deepspeed.init_distributed`, and the
one rule for how long a process group waits.

On a GPU node each rank must select its own device (`LOCAL_RANK`) before the world group exists: NCCL binds
a communicator to the current device, and every CUDA call before `set_device` (an RNG state read, the tensor
of a collective such as `broadcast_object_list`) makes a context on GPU 0. With the current device left at
cuda:0 on every rank, the first collective's tensors sit on cuda:0 while the world group is bound to
cuda:LOCAL_RANK: NCCL refuses them on ranks 1..N-1 and rank 0 waits for ever.
"""

import os
from datetime import timedelta


def process_group_timeout(timeout_seconds: float) -> timedelta:
    """How long every process group (the world's and each TP/PP/DP/CP/EP group) waits in a collective:
    twice `hybrid3d.timeout_seconds`, so hybrid3d's Watchdog reports a hang (rank, step, phase) before the
    communication library aborts it. A group made without a timeout would wait torch's default instead
    (10 minutes on NCCL, 30 on gloo)."""
    return timedelta(seconds=2 * timeout_seconds)


def start_world(timeout: timedelta | None = None, backend: str | None = None) -> None:
    """Select this rank's accelerator device, then initialise `deepspeed.comm` over the launcher's variables
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from hybrid3d.ds_internals.cpu_info import share_cpu_info

    share_cpu_info()  # the op loads ahead (CPU Adam, fused Adam) probe the CPU once per machine run, not twice per op
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    kwargs = {"timeout": timeout} if timeout is not None else {}
    deepspeed.init_distributed(dist_backend=backend, verbose=False, **kwargs)
