"""When TP sums may take DeepSpeed's shared-memory kernel (ds_internals/shm_all_reduce.py): only where it is a
correct sum over the group. The kernel reduces over the whole world whatever group it is given and has buffers
only where every rank is on this host, so each missing condition must send the sum through the process group.
The path itself runs against HF in tests/distributed/test_tensor_parallel.py (TP4 over a world of 4)."""

import types

import pytest
from deepspeed.comm import comm as ds_comm

from hybrid3d.ds_internals import shm_all_reduce

WORLD = 4


@pytest.fixture
def host(monkeypatch):
    """A world of 4 ranks on this host with the kernel built; each test takes one condition away."""
    monkeypatch.setattr(ds_comm, "cdb", types.SimpleNamespace(shm_comm_op=object()))
    monkeypatch.setenv("LOCAL_SIZE", str(WORLD))
    sizes = {None: WORLD, "world": WORLD, "half": WORLD // 2}
    monkeypatch.setattr(shm_all_reduce.dist, "get_world_size", lambda group=None: sizes[group])
    return monkeypatch


def test_a_group_of_the_whole_world_on_one_host_takes_the_kernel(host):
    assert shm_all_reduce.shm_all_reduce_spans("world")


def test_a_group_smaller_than_the_world_does_not(host):
    assert not shm_all_reduce.shm_all_reduce_spans("half")


def test_ranks_on_other_hosts_do_not(host):
    host.setenv("LOCAL_SIZE", str(WORLD // 2))
    assert not shm_all_reduce.shm_all_reduce_spans("world")
    host.delenv("LOCAL_SIZE")
    assert not shm_all_reduce.shm_all_reduce_spans("world")


def test_without_the_kernel_or_the_backend_it_does_not(host):
    host.setattr(ds_comm, "cdb", types.SimpleNamespace(shm_comm_op=None))
    assert not shm_all_reduce.shm_all_reduce_spans("world")
    host.setattr(ds_comm, "cdb", None)
    assert not shm_all_reduce.shm_all_reduce_spans("world")


def test_other_accelerators_do_not(host):
    import deepspeed.accelerator

    host.setattr(deepspeed.accelerator, "get_accelerator", lambda: types.SimpleNamespace(device_name=lambda: "cuda"))
    assert not shm_all_reduce.shm_all_reduce_spans("world")
