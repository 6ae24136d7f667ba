"""The process groups a run makes: how long they wait, and ending them while the world goes on (the tests'
pooled worlds run many runs in one).

Each run builds its TP/PP/DP/CP/EP groups (and DeepSpeed builds its own); nothing destroys them when the run
ends. `release_process_groups` destroys every group but the world's and empties the registries of DeepSpeed
0.19.8 `utils/groups.py` that point at them, so the next run's groups are the only ones torch knows. The
C++ groups (on gloo, two threads each) live on while a DeepSpeed engine holds them, and an engine outlives its
run: its ZeRO/bf16 optimizer's gradient-accumulation hooks live in autograd's C++ graph, out of sight of
Python's garbage collector, and hold the optimizer and with it the engine. `destroy_engines` calls DeepSpeed's
own `engine.destroy()` (which removes those hooks) on every engine a run left. The gloo groups' threads
outlive even that (counted in parallel/spawn.py).
"""

import gc
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as torch_dist


@contextmanager
def new_groups_wait(timeout: timedelta):
    """Inside the block every group made through `deepspeed.comm.new_group` waits `timeout` in a collective:
    DeepSpeed's pipeline grid, its engines' and MoE groups, and hybrid3d's own all make theirs that way, and
    DeepSpeed 0.19.8's torch backend (`comm/torch.py` `new_group`) passes no timeout, so torch's default
    (10 minutes on NCCL, 30 on gloo) would hold instead of the world's."""
    from deepspeed.comm import comm

    backend = comm.cdb
    backend.new_group = lambda ranks: torch_dist.new_group(ranks, timeout=timeout)  # shadows the method
    try:
        yield
    finally:
        del backend.new_group


def destroy_engines() -> int:
    """`destroy()` every DeepSpeed engine still alive in this process, so the next garbage collection frees it (see
    the module docstring); returns how many. For a process that runs many runs (the pooled worlds), between runs."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    engines = [obj for obj in gc.get_objects() if _is_instance(obj, DeepSpeedEngine)]
    for engine in engines:
        engine.destroy()
    return len(engines)


def _is_instance(obj, cls) -> bool:
    try:
        return isinstance(obj, cls)
    except ReferenceError:  # a weak proxy whose object is gone (torch.compile's caches keep some)
        return False


def release_process_groups() -> int:
    """Destroy every process group of this process except the default one; returns how many it destroyed.
    Local to the rank (no collective); every rank of the world calls it between runs."""
    from deepspeed.utils import groups

    world = torch_dist.distributed_c10d._get_default_group()
    subgroups = [pg for pg in list(torch_dist.distributed_c10d._world.pg_map) if pg is not world]
    for group in subgroups:
        torch_dist.destroy_process_group(group)
    for registry in (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS,
                     groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS,
                     groups._ALL_TO_ALL_GROUP):
        registry.clear()
    for name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP",
                 "_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE",
                 "_MPU_TENSOR_MODEL_PARALLEL_RANK"):
        setattr(groups, name, None)
    groups.mpu = None
    return len(subgroups)
