"""Whether a group's SUM all-reduces may take DeepSpeed's CPU shared-memory kernel.

On the CPU accelerator DeepSpeed builds the `deepspeed_shm_comm` op at `init_distributed` and serves
`deepspeed.comm.inference_all_reduce` with it: the ranks add their tensors through `/dev/shm` instead of
gloo's TCP loopback (measured on this project's 2-core VM, 2 ranks: 256 KiB fp32 in 0.05 ms against gloo's
1.4 ms; sums bit-identical). DeepSpeed 0.19.8's kernel has two limits the caller must respect
(`comm/torch.py: TorchBackend.inference_all_reduce`, `ops/csrc/cpu/comm/shm_interface.cpp`):

- it reduces over the whole world, whatever `group` it is passed, so the group must be the world;
- it has buffers only where every rank is on this host (`LOCAL_SIZE` == world size at start-up); elsewhere
  it would read unmapped memory.

For dtypes or CPUs the kernel cannot take (avx2 for fp32, avx512bw for bf16), DeepSpeed itself falls back
to `torch.distributed.all_reduce` over the group.
"""

import os

import deepspeed.comm as dist


def shm_all_reduce_spans(group) -> bool:
    """True where `inference_all_reduce` over `group` is a correct, shared-memory SUM all-reduce."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm import comm as ds_comm

    backend = ds_comm.cdb
    if backend is None or getattr(backend, "shm_comm_op", None) is None:
        return False
    if get_accelerator().device_name() != "cpu":
        return False
    world = dist.get_world_size()
    return int(os.environ.get("LOCAL_SIZE", "0")) == world and dist.get_world_size(group=group) == world
