"""CPU threads per rank: an equal share of the usable cores, OMP_NUM_THREADS wins."""

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
