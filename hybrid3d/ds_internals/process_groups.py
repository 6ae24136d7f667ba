"""Ending a run's process groups while its world goes on (the tests' pooled worlds run many runs in one).

Each run builds its TP/PP/DP/CP/EP groups (and DeepSpeed builds its own); nothing destroys them when the run
ends, and on gloo every group keeps a receive loop and a TCP loop thread per process: ~700 threads per rank
after the distributed tests (counted with `ps -L`). `release_process_groups` destroys every group but the
world's and empties the registries of DeepSpeed 0.19.8 `utils/groups.py` that point at them.
"""

import torch.distributed as torch_dist


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
