"""Ring attention over a context-parallel group (`context_parallel_comm: "p2p"`): any number of ranks, whatever the
heads (Liu et al. 2023, "Ring Attention with Blockwise Transformers"; Megatron's p2p context parallelism).

Layout (Megatron's causal load balance): the sequence is cut into 2c chunks and rank r holds chunks r and 2c-1-r
(`chunk_positions`; with a2a+p2p each chunk is further cut over the Ulysses ranks, `rank_positions`), so every rank has as many causal (query, key) pairs to compute as any other.

Forward: each rank keeps its queries; the K/V blocks (kv heads as they are, GQA not repeated) travel around the ring
with point-to-point sends to the next rank and receives from the previous one, c-1 hops, each overlapped with the
block attention of the block in hand. Blocks merge by their log-sum-exp (online softmax, Milakov & Gimelshein 2018):
out = Σ_j exp(lse_j - lse) out_j with lse = log Σ_j exp(lse_j). A (query chunk, key chunk) pair wholly in the future
is skipped. Backward runs the same ring: dQ accumulates on the query's rank; dK/dV travel with their K/V block and
arrive home after one more hop (FlashAttention-2's backward per block, Dao 2023: P = exp(S - lse),
dS = P ∘ (dP - rowsum(dO ∘ O))).

Blocks are computed with plain matmuls in fp32 (the CPU path; a fused kernel returning the log-sum-exp, as the flash
and efficient SDPA ops do on GPUs, is not used yet).
"""

import math

import torch
import torch.distributed as torch_dist

from hybrid3d.parallel.rank_groups import ContextParallelGroup


def chunk_positions(rank: int, c: int, s: int, device=None) -> torch.Tensor:
    """The global positions ring member `rank` of c holds: chunks rank and 2c-1-rank of 2c equal chunks. (s/c,)"""
    chunk = s // (2 * c)
    first, second = rank, 2 * c - 1 - rank
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])


def rank_positions(rank: int, c: int, a2a: int, s: int, device=None) -> torch.Tensor:
    """The positions CP rank `rank` of c holds in the data: its ring member's two chunks (ring of c/a2a), each cut
    into a2a parts of which it takes part rank % a2a (a2a+p2p; a2a = 1: the whole chunks). (s/c,) long."""
    member, part = rank // a2a, rank % a2a
    chunks = chunk_positions(member, c // a2a, s, device).view(2, a2a, -1)  # (2 chunks, a2a parts, s/(2c))
    return chunks[:, part].reshape(-1)


def member_positions(member: int, c: int, a2a: int, s: int, device=None) -> torch.Tensor:
    """The positions ring member `member` attends with: its a2a ranks' positions in their order, as Ulysses'
    all-to-all gathers them (a2a = 1: the rank's own). (a2a·s/c,) long."""
    return torch.cat([rank_positions(member * a2a + k, c, a2a, s, device) for k in range(a2a)])


def ring_shard(x: torch.Tensor, cp: ContextParallelGroup) -> torch.Tensor:
    """(b, s, ...) -> (b, s/c, ...): this rank's positions (`rank_positions`), in that order."""
    return x[:, rank_positions(cp.rank, cp.size, cp.a2a_size, x.shape[1], x.device)].contiguous()


class _Ring:
    """The neighbours of this rank in the CP group and an exchange of tensors with them."""

    def __init__(self, cp: ContextParallelGroup):
        ranks = torch_dist.get_process_group_ranks(cp.group)
        self.group = cp.group
        self.next, self.prev = ranks[(cp.rank + 1) % cp.size], ranks[(cp.rank - 1) % cp.size]

    def start(self, tensors: list) -> tuple[list, list]:
        """Send `tensors` to the next rank and receive as many from the previous one, asynchronously:
        (received buffers, requests to wait for)."""
        received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = [torch_dist.P2POp(torch_dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [torch_dist.P2POp(torch_dist.irecv, r, self.prev, self.group) for r in received]
        return received, torch_dist.batch_isend_irecv(ops)


def _wait(requests) -> None:
    for request in requests:
        request.wait()


def _scores(q, k, scale, q_pos, k_pos):
    """Scaled scores of q (b, g, h/g, n, d) against k (b, g, m, d) in fp32 and the causal mask (n, m), or None
    when no query sees any key."""
    visible = k_pos[None, :] <= q_pos[:, None]  # (n, m)
    if not visible.any():
        return None, None
    s = torch.einsum("bgind,bgmd->bginm", q.float(), k.float()) * scale
    return s.masked_fill(~visible, float("-inf")), visible


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole sequence held across the ring `cp`.
    q (b, h, n, d), k/v (b, g, n, d) with g kv heads dividing h, after RoPE at their global positions;
    `table` (c, n): the global positions of every ring member's n tokens, row cp.rank this rank's. -> (b, h, n, d)."""

    @staticmethod
    def forward(ctx, q, k, v, table, cp: ContextParallelGroup):
        b, h, n, d = q.shape
        g = k.shape[1]
        scale = 1.0 / math.sqrt(d)
        ring = _Ring(cp)
        qg = q.view(b, g, h // g, n, d)
        out = torch.zeros(b, g, h // g, n, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, g, h // g, n), float("-inf"), device=q.device)
        block = [k, v]
        for step in range(cp.size):
            requests = None
            if step < cp.size - 1:
                received, requests = ring.start(block)
            source = (cp.rank - step) % cp.size
            s, _ = _scores(qg, block[0], scale, table[cp.rank], table[source])
            if s is not None:
                block_lse = torch.logsumexp(s, dim=-1)  # (b, g, h/g, n); -inf where the row sees nothing
                p = torch.exp(s - block_lse.unsqueeze(-1)).nan_to_num(0.0)
                block_out = torch.einsum("bginm,bgmd->bgind", p, block[1].float())
                merged = torch.logaddexp(lse, block_lse)
                old = torch.exp(lse - merged).nan_to_num(0.0).unsqueeze(-1)
                new = torch.exp(block_lse - merged).nan_to_num(0.0).unsqueeze(-1)
                out = out * old + block_out * new
                lse = merged
            if requests is not None:
                _wait(requests)
                block = received
        ctx.cp, ctx.scale = cp, scale
        ctx.save_for_backward(q, k, v, table, out, lse)
        return out.view(b, h, n, d).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, table, out, lse = ctx.saved_tensors
        cp, scale = ctx.cp, ctx.scale
        b, h, n, d = q.shape
        g = k.shape[1]
        ring = _Ring(cp)
        qg = q.view(b, g, h // g, n, d)
        dout = grad_out.reshape(b, g, h // g, n, d).float()
        delta = (dout * out).sum(-1, keepdim=True)  # (b, g, h/g, n, 1): rowsum(dO ∘ O)
        dq = torch.zeros(b, g, h // g, n, d, dtype=torch.float32, device=q.device)
        block = [k, v, torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)]
        for step in range(cp.size):
            source = (cp.rank - step) % cp.size
            bk, bv, dk, dv = block
            s, _ = _scores(qg, bk, scale, table[cp.rank], table[source])
            if s is not None:
                p = torch.exp(s - lse.unsqueeze(-1))  # (b, g, h/g, n, m); 0 where masked
                dv = dv + torch.einsum("bginm,bgind->bgmd", p, dout)
                dp = torch.einsum("bgind,bgmd->bginm", dout, bv.float())
                ds = p * (dp - delta) * scale
                dq = dq + torch.einsum("bginm,bgmd->bgind", ds, bk.float())
                dk = dk + torch.einsum("bginm,bgind->bgmd", ds, qg.float())
            # every block moves on (the K/V to the next rank's queries, or their gradients home after the last)
            tensors = [dk, dv] if step == cp.size - 1 else [bk, bv, dk, dv]
            received, requests = ring.start(tensors)
            _wait(requests)
            block = received
        dk, dv = block  # our own K/V's gradients, back from the previous rank
        return dq.view(b, h, n, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(q, k, v, table: torch.Tensor, ring: ContextParallelGroup):
    """Causal attention over the sequence held around `ring`: q (b, h, n, d), k/v (b, g, n, d) at the positions
    `table[ring.rank]` (RoPE applied), `table` (c, n) every member's (`member_positions`). -> (b, h, n, d)."""
    return RingAttention.apply(q, k, v, table, ring)


def position_table(cp: ContextParallelGroup, s: int, device=None) -> torch.Tensor:
    """(c/a2a, a2a·s/c): `member_positions` of every member of this rank's ring, for sequences of s."""
    ring = cp.ring_members()
    return torch.stack([member_positions(j, cp.size, cp.a2a_size, s, device) for j in range(ring.size)])
