"""CPU threads per rank: an equal share of the usable cores, OMP_NUM_THREADS wins."""

import pytest
import torch

from hybrid3d.parallel.threads import local_ranks, set_cpu_threads, threads_per_rank, usable_cores


def test_share_of_the_cores():
    assert threads_per_rank(4, 2) == 1  # more ranks than cores: one each, never zero
    assert threads_per_rank(2, 16) == 8
    assert threads_per_rank(3, 16) == 5
    assert threads_per_rank(0, 4) == 4


def test_local_ranks_from_either_launcher(monkeypatch):
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert local_ranks() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert local_ranks() == 3
    monkeypatch.setenv("LOCAL_SIZE", "4")  # DeepSpeed's launcher
    assert local_ranks() == 4


def test_set_and_override(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        line = set_cpu_threads(usable_cores())
        assert torch.get_num_threads() == 1 and line.startswith("CPU threads per rank: 1 (")
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert set_cpu_threads(usable_cores()) == "CPU threads per rank: 2 (OMP_NUM_THREADS)"
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_job_shares_the_cores_on_any_accelerator(monkeypatch):
    """A GPU rank sets its threads too (issue 32, finding 9: only CPU ranks did, so each of 8 GPU ranks ran as many
    host threads as the node has cores)."""
    import types

    from hybrid3d.training import job

    class Chosen(Exception):
        pass

    def set_threads(ranks):
        raise Chosen(ranks)

    monkeypatch.setattr(job, "get_accelerator", lambda: types.SimpleNamespace(device_name=lambda: "cuda"))
    monkeypatch.setattr(job, "set_cpu_threads", set_threads)
    monkeypatch.setenv("LOCAL_SIZE", "8")
    fake_job = types.SimpleNamespace(hybrid=None, layout=None, verbose=False, override_log=[])
    with pytest.raises(Chosen) as chosen:
        job.run_in_world(fake_job, eval_only=False, rank=0)
    assert chosen.value.args == (8,)
