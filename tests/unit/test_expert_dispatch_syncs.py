"""Expert-parallel dispatch waits for the device once per call: the split sizes and rows per expert are read in
one host copy (issue 32, finding 5: it read them in three `.tolist()`s, plus `bincount` and a `repeat_interleave`
without `output_size`, each a device-to-host wait on a GPU)."""

import types

import torch

from hybrid3d.parallel import expert_parallel
from hybrid3d.parallel.rank_groups import ExpertParallelGroup
from tests.counters import HostReads

def test_dispatch_reads_the_device_once(monkeypatch):
    def all_to_all_single(out, x, output_split_sizes=None, input_split_sizes=None, group=None):
        out.copy_(x)  # one rank: what it sends is what it receives

    monkeypatch.setattr(expert_parallel, "dist", types.SimpleNamespace(all_to_all_single=all_to_all_single))
    ep = ExpertParallelGroup(group=None, rank=0, size=1)
    x = torch.randn(6, 4)
    indices = torch.tensor([[0, 2], [1, 3], [3, 0], [4, 1], [2, 2], [0, 4]])  # 4 experts; index 4 = dropped
    with HostReads() as reads:
        rows, rows_per_expert, plan = expert_parallel.dispatch(x, indices, num_experts=4, ep=ep)
        out = expert_parallel.combine(rows, plan)
    assert reads.calls == ["tolist"], reads.calls
    # and the result is what the slow way gave: rows grouped by expert, the dropped assignments left out
    assert rows_per_expert == [3, 2, 3, 2] and plan.send == plan.recv == [10]
    experts = indices.reshape(-1)[plan.order].tolist()
    assert experts == sorted(experts) and 4 not in experts
    assert torch.equal(out, x[plan.order // 2])  # combine returns each kept assignment's row to its token
