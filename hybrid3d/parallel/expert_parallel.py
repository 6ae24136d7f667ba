"""Expert parallelism: token dispatch to the ranks holding their experts and the combine back, without dropping.

GShard (Lepikhin et al. 2021, §2.2-2.3) and DeepSpeed-MoE (Rajbhandari et al. 2022, §4-5) place whole experts
on the e ranks of an expert-parallel group (EP rank r holds experts [r·E/e, (r+1)·E/e)) and move tokens
with two all-to-alls: dispatch sends each token's hidden state to the ranks of its k experts, combine
sends the expert outputs back. Both papers give each expert a fixed capacity so that every all-to-all moves
equal-size blocks, and drop the tokens over capacity; Mixtral (and the HF reference) drops nothing, so here
the blocks have the sizes routing produced: the per-expert counts are exchanged first (one all-to-all of E
integers), then the hidden states with `all_to_all_single`'s split sizes.

Order, which equivalence with the single-process model rests on:
- dispatch sorts the n·k (token, slot) assignments by expert, stably: for each expert its assignments in
  (token, slot) order, exactly `torch.where(indices == e)`'s order in the single-process loop;
- the block sent to EP rank j is its experts' assignments, expert by expert; a receiver gets one block per
  source rank and regroups the rows by local expert (stably, so source by source), runs each expert on one
  contiguous chunk, and puts the rows back in the received order for the return trip;
- combine returns the outputs to their sources in the sorted order of dispatch, where the caller weights and
  sums them into the tokens.
Gradients go back the same way: the backward of an all-to-all is the all-to-all with the splits swapped
(`AllToAll`). Routing statistics for the load-balancing loss stay on the source rank (the loss of each
micro-batch is taken over its own tokens), so nothing here touches them.

All collectives go through `deepspeed.comm` so that DeepSpeed's comms logger counts them.
"""

from dataclasses import dataclass

import deepspeed.comm as dist
import torch

from hybrid3d.parallel.rank_groups import ExpertParallelGroup


class AllToAll(torch.autograd.Function):
    """Rows (n, ...) split as `send` (one block per rank, in rank order) -> rows (sum(recv), ...): block j of the
    output came from rank j. Backward: the reverse all-to-all, `recv` blocks out and `send` blocks back."""

    @staticmethod
    def forward(ctx, x, send: list, recv: list, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, send: list, recv: list, group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


@dataclass(frozen=True)
class DispatchPlan:
    """What `combine` needs to send the expert outputs back. Lengths: a = n·k assignments, r received rows."""

    order: torch.Tensor  # (a',) kept assignment ids (token·k + slot) sorted by expert: the order of `combine`'s output
    send: list  # rows sent to each EP rank
    recv: list  # rows received from each EP rank
    restore: torch.Tensor  # (r,) position of each received row in the expert-grouped rows
    group: object


def dispatch(x: torch.Tensor, indices: torch.Tensor, num_experts: int, ep: ExpertParallelGroup):
    """x (n, h), indices (n, k) of global experts -> (rows (r, h) grouped by local expert, rows per local expert
    (list of E/e ints), plan). A collective over the EP group: every EP rank calls it for the same layer."""
    k = indices.shape[1]
    local = num_experts // ep.size  # L experts per rank
    flat = indices.reshape(-1)  # (a,); an index of E marks an assignment dropped by the expert capacity
    order = torch.argsort(flat, stable=True)  # (a,) assignments grouped by expert, the dropped ones last
    # (E,) assignments per expert, counted on the device (bincount reads the largest index on the host first)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=x.device).index_add_(
        0, flat, torch.ones_like(flat))[:num_experts]
    # Each rank learns how many rows of each of its experts every source sends: counts are sent in blocks
    # of L (block j = rank j's experts), so the receiver's (e, L) table is [source, local expert].
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=ep.group)
    table = received.view(ep.size, local)  # (e, L)
    # The one wait for the device per dispatch: the all-to-all split sizes and the rows per local expert are host
    # integers, read in a single copy (each .tolist() is a device-to-host copy that waits for the stream).
    sizes = torch.cat((counts.view(ep.size, local).sum(dim=1), table.sum(dim=1), table.sum(dim=0))).tolist()
    send, recv, rows_per_expert = sizes[:ep.size], sizes[ep.size:2 * ep.size], sizes[2 * ep.size:]
    order = order[:sum(send)]  # (a',) the assignments that run
    rows = AllToAll.apply(x.index_select(0, order // k), send, recv, ep.group)  # (r, h), source-major
    # Regroup by local expert, source by source within each: a stable sort of each row's local expert id.
    expert_of_row = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(ep.size), table.reshape(-1),
                                            output_size=sum(recv))  # (r,); the size given, so no second wait
    regroup = torch.argsort(expert_of_row, stable=True)  # (r,)
    plan = DispatchPlan(order=order, send=send, recv=recv, restore=torch.argsort(regroup), group=ep.group)
    return rows.index_select(0, regroup), rows_per_expert, plan


def combine(y: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Expert outputs y (r, h), grouped by local expert as `dispatch` returned the rows -> (a', h) back on their
    source rank, row j the output for assignment `plan.order[j]`."""
    return AllToAll.apply(y.index_select(0, plan.restore), plan.recv, plan.send, plan.group)
