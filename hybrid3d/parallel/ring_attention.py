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

Each rank's tokens come in segments of consecutive positions (its chunks, or with a2a+p2p their parts), so a key
segment is wholly before a query segment (attended whole), the same one (causal) or after it (skipped): each block
is one call of a block kernel that returns the log-sum-exp (parallel/attention_blocks.py: torch's fused flash
kernel on CPUs; on CUDA GPUs its memory-efficient kernel for unmasked blocks, explicit fp32 tiles for masked ones).

Packed documents and sliding windows (`BlockMask`): a key segment none of whose keys a query segment may see (another
document, or outside the window) is left out of the block, and a block with none left is skipped; the rest run with
an explicit mask built from the global positions. A query row with no key in a block gets the log-sum-exp -inf there
(the CPU kernel reports 0), so it adds nothing to the merge.
"""

import torch
import torch.distributed as torch_dist

from hybrid3d.parallel.attention_blocks import block_kernel
from hybrid3d.parallel.attention_visibility import visible
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


def _blocks(q_starts: list, k_starts: list, length: int):
    """The attention blocks of one query set against one key set: (query rows, key segments, causal). Segments are
    runs of `length` consecutive positions starting at multiples of it, so a key segment is wholly before a query
    segment (one block of all such segments), the same one (a causal block), or wholly after it (no block)."""
    for i, start in enumerate(q_starts):
        rows = slice(i * length, (i + 1) * length)
        before = [j for j, k in enumerate(k_starts) if k < start]
        if before:
            yield rows, before, False
        yield from ((rows, [j], True) for j, k in enumerate(k_starts) if k == start)


class BlockMask:
    """Which keys a query may see beyond causality, by global position (`attention_visibility.visible`): the same packed document
    (`segments` (b, s), `masks.document_segments` of the whole sequence) and, with a `window`, the last `window`
    positions (Mistral's sliding window). None of either: plain causal blocks, no mask."""

    def __init__(self, segments=None, window=None):
        self.segments, self.window = segments, window

    def __bool__(self):
        return self.segments is not None or self.window is not None

    def allowed(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """(nq,) and (nk,) global positions -> (b or 1, 1, nq, nk) bool, True where the query may see the key
        (`attention_visibility.visible`)."""
        allowed = visible(q_pos, k_pos, self.window, self.segments)
        return allowed if allowed.dim() == 4 else allowed[None, None]

    def blocks(self, q_table_row: torch.Tensor, k_table_row: torch.Tensor, length: int, dtype):
        """`_blocks` of a query set against a key set, each as (query rows, key segments, additive mask or None,
        rows with no key or None), with the key segments no query of the block may see left out, and blocks left
        with none skipped."""
        for rows, keys, causal in _blocks(q_table_row[::length].tolist(), k_table_row[::length].tolist(), length):
            if not self:
                yield rows, keys, causal, None, None
                continue
            q_pos = q_table_row[rows]
            masks = {j: self.allowed(q_pos, k_table_row[j * length:(j + 1) * length]) for j in keys}
            keys = [j for j in keys if masks[j].any()]
            if keys:
                allowed = torch.cat([masks[j] for j in keys], dim=-1)  # (b or 1, 1, nq, nk)
                bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
                    ~allowed, float("-inf"))
                yield rows, keys, False, bias, ~allowed.any(-1)  # (b or 1, 1, nq): rows that see nothing here


def _segments(x, indices: list, length: int):
    """The segments `indices` of x (..., n, d) concatenated along n: (..., len(indices)·length, d)."""
    return torch.cat([x[..., j * length:(j + 1) * length, :] for j in indices], dim=-2)


def _merge(out, lse, block_out, block_lse):
    """Online softmax: two partial attentions over disjoint keys, by their log-sum-exps. out fp32 (..., n, d)."""
    merged = torch.logaddexp(lse, block_lse)  # -inf where neither saw a key yet: both weights 0, not nan
    out = out * torch.exp(lse - merged).nan_to_num(0.0).unsqueeze(-1) + block_out.float() * torch.exp(
        block_lse - merged).nan_to_num(0.0).unsqueeze(-1)
    return out, merged


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole sequence held across the ring `cp`.
    q (b, h, n, d), k/v (b, g, n, d) with g kv heads dividing h, after RoPE at their global positions;
    `table` (c, n): the global positions of every ring member's n tokens, row cp.rank this rank's, in segments of
    `length` consecutive positions; `mask`: documents and window (`BlockMask`). -> (b, h, n, d).

    Each (query segment, key segments) pair runs `kernel` (attention_blocks.py), which returns the log-sum-exp the
    merge needs and whose backward takes the merged output and log-sum-exp (FlashAttention-2's per-block backward)."""

    @staticmethod
    def forward(ctx, q, k, v, table, length: int, cp: ContextParallelGroup, mask: BlockMask, kernel):
        b, h, n, d = q.shape
        repeat = h // k.shape[1]  # the kernels take as many kv heads as q heads: repeated here, not sent
        ring = _Ring(cp)
        out = torch.zeros(b, h, n, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, n), float("-inf"), device=q.device)
        block = [k, v]
        for step in range(cp.size):
            requests = None
            if step < cp.size - 1:
                received, requests = ring.start(block)
            source = (cp.rank - step) % cp.size
            bk, bv = (t.repeat_interleave(repeat, dim=1) for t in block)
            for rows, keys, causal, bias, blind in mask.blocks(table[cp.rank], table[source], length, q.dtype):
                o, l = kernel.forward(q[:, :, rows], _segments(bk, keys, length), _segments(bv, keys, length), causal,
                                      bias)
                if blind is not None:  # the CPU kernel's log-sum-exp of a row that sees no key is 0, not -inf
                    l = l.masked_fill(blind, float("-inf"))  # (b or 1, 1, rows) over (b, h, rows)
                out[:, :, rows], lse[:, :, rows] = _merge(out[:, :, rows], lse[:, :, rows], o, l)
            if requests is not None:
                _wait(requests)
                block = received
        result = out.to(q.dtype)
        ctx.cp, ctx.length, ctx.mask, ctx.kernel = cp, length, mask, kernel
        ctx.save_for_backward(q, k, v, table, result, lse)
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, table, out, lse = ctx.saved_tensors
        cp, length, mask = ctx.cp, ctx.length, ctx.mask
        b, h, n, d = q.shape
        g = k.shape[1]
        repeat = h // g
        ring = _Ring(cp)
        grad_out = grad_out.contiguous()
        dq = torch.zeros(b, h, n, d, dtype=torch.float32, device=q.device)
        block = [k, v, torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)]
        for step in range(cp.size):
            source = (cp.rank - step) % cp.size
            bk, bv, dk, dv = block
            rk, rv = (t.repeat_interleave(repeat, dim=1) for t in (bk, bv))
            dk_heads = torch.zeros(b, h, n, d, dtype=torch.float32, device=q.device)  # per q head, summed below
            dv_heads = torch.zeros(b, h, n, d, dtype=torch.float32, device=q.device)
            for rows, keys, causal, bias, _ in mask.blocks(table[cp.rank], table[source], length, q.dtype):
                gq, gk, gv = ctx.kernel.backward(grad_out[:, :, rows], q[:, :, rows], _segments(rk, keys, length),
                                                 _segments(rv, keys, length), out[:, :, rows], lse[:, :, rows],
                                                 causal, bias)
                dq[:, :, rows] += gq.float()
                for piece, j in enumerate(keys):  # each key segment's share of the gradient
                    part = slice(piece * length, (piece + 1) * length)
                    dk_heads[:, :, j * length:(j + 1) * length] += gk[:, :, part].float()
                    dv_heads[:, :, j * length:(j + 1) * length] += gv[:, :, part].float()
            dk = dk + dk_heads.view(b, g, repeat, n, d).sum(2)  # the repeated heads' gradients to their kv head
            dv = dv + dv_heads.view(b, g, repeat, n, d).sum(2)
            # every block moves on (the K/V to the next rank's queries, or their gradients home after the last)
            tensors = [dk, dv] if step == cp.size - 1 else [bk, bv, dk, dv]
            received, requests = ring.start(tensors)
            _wait(requests)
            block = received
        dk, dv = block  # our own K/V's gradients, back from the previous rank
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(q, k, v, table: torch.Tensor, length: int, ring: ContextParallelGroup,
                   mask: BlockMask | None = None, kernel=None):
    """Causal attention over the sequence held around `ring`: q (b, h, n, d), k/v (b, g, n, d) at the positions
    `table[ring.rank]` (RoPE applied), `table` (c, n) every member's (`member_positions`), in segments of `length`
    consecutive positions; `mask` packed documents and a sliding window, if any; `kernel` the blocks' kernel
    (default: `attention_blocks.block_kernel` of q's device). -> (b, h, n, d)."""
    return RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), table, length, ring,
                               mask if mask is not None else BlockMask(), kernel or block_kernel(q.device))


def position_table(cp: ContextParallelGroup, s: int, device=None) -> torch.Tensor:
    """(c/a2a, a2a·s/c): `member_positions` of every member of this rank's ring, for sequences of s."""
    ring = cp.ring_members()
    return torch.stack([member_positions(j, cp.size, cp.a2a_size, s, device) for j in range(ring.size)])
