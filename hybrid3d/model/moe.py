"""Mixture-of-experts feed-forward (Mixtral, Jiang et al. 2024) and its load-balancing loss.

Each token goes to the k of E SwiGLU experts with the highest router probability; the output is the
sum of their outputs weighted by those k probabilities renormalised to sum to 1. By default every token is
processed (no capacity limit, nothing dropped; `hybrid3d.expert_capacity_factor` sets one, `capacity_keep`):
each expert runs on the tokens routed to it (the assignments sorted by expert once, the rows gathered, run as grouped
GEMMs or one GEMM per expert (model/expert_kernels.py), then index_add into the output), the order of operations of
HF's `MixtralSparseMoeBlock`, so fp32 results equal it (the grouped kernel's within an ulp, its docstring says why).

Load balancing (Switch Transformer, Fedus et al. 2022, eqs. 4-6; GShard, Lepikhin et al. 2021, §2.2):
    aux = E · Σ_e f_e · P_e,  f_e = (assignments of tokens to e) / N,  P_e = (Σ router probability of e) / N,
with N = MoE layers × tokens. As in HF's `load_balancing_loss_func`, f and P are taken over all layers'
tokens together, which is not the mean of per-layer losses. So each layer adds its sums to running
statistics, one flat fp32 tensor `router_stats` = [assignment counts (E) | probability sums (E) | rows (1)]
that travels with the hidden state from block to block (and from pipeline stage to stage, as the second
tensor of the activation tuple); `load_balancing_loss` combines them once, at the loss. The counts
carry no gradient (a top-k choice is not differentiable); the probability sums do.

With TP each rank holds an f/t slice of every expert (gate/up column-, down row-parallel, as in the
dense SwiGLU) and the router is replicated, so every rank routes every token alike: the experts'
partial outputs are summed over TP once for all experts (g), and the input and routing-weight
gradients, partial per rank, are summed once (f).

With expert parallelism (GShard, Lepikhin et al. 2021; DeepSpeed-MoE, Rajbhandari et al. 2022) each of the e
ranks of the expert-parallel group holds E/e whole experts and tokens travel to them by all-to-all and back
(parallel/expert_parallel.py); routing and its statistics stay on the token's own rank. With TP as well, each
TP rank exchanges its tokens with the ranks of the same TP index and the f/g pair above is unchanged.

Why not DeepSpeed's `deepspeed.moe.layer.MoE`: its `TopKGate` cannot reproduce Mixtral. Its top-2 picks the
second expert from Gumbel-noised logits (`top2gating`, `top2_2nd_expert_sampling`), caps each expert's tokens
at a capacity and drops the rest (`drop_tokens`), and computes its own auxiliary loss per layer from the
first choice only; HF's Mixtral takes an exact top-k, drops nothing and pools the load-balancing statistics of
all k choices over all layers. hybrid3d keeps its router and
hands DeepSpeed only what its engine needs to treat the experts as expert parameters (ds_internals/experts.py).
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from hybrid3d.model.config import LlamaShape
from hybrid3d.model.expert_kernels import choose_kernel, contiguous_experts, run_experts, sort_by_expert
from hybrid3d.parallel.expert_parallel import combine, dispatch
from hybrid3d.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelGroup,
    copy_to_tp_region,
    reduce_from_tp_region,
)
from hybrid3d.parallel.rank_groups import ExpertParallelGroup
from hybrid3d.parallel.tensor_parallel.layers import draw_device, init_shard_, normal_init


def layer_router_stats(probs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """One layer's sums: probs (n, E) fp32, indices (n, k) -> (2E + 1,) fp32."""
    n, num_experts = probs.shape
    ones = torch.ones(indices.numel(), dtype=torch.float32, device=probs.device)
    # index_add rather than bincount: no device-to-host sync for the output size
    counts = torch.zeros(num_experts, dtype=torch.float32, device=probs.device).index_add_(0, indices.reshape(-1), ones)
    rows = torch.full((1,), float(n), dtype=torch.float32, device=probs.device)
    return torch.cat((counts, probs.sum(dim=0), rows))


def load_balancing_loss(router_stats: torch.Tensor, num_experts: int) -> torch.Tensor:
    """aux = E · Σ_e (counts_e / N) · (prob_sums_e / N) from summed `router_stats` (2E + 1,) -> scalar."""
    counts, prob_sums = router_stats[:num_experts], router_stats[num_experts:2 * num_experts]
    rows = router_stats[2 * num_experts].clamp(min=1)
    return torch.sum((counts / rows) * (prob_sums / rows)) * num_experts


def expert_capacity(assignments: int, num_experts: int, capacity_factor: float) -> int:
    """Assignments one expert takes of a rank's `assignments` (n·k) at `capacity_factor`: ceil(c·n·k / E)."""
    return math.ceil(capacity_factor * assignments / num_experts)


def capacity_keep(indices: torch.Tensor, num_experts: int, capacity_factor: Optional[float]) -> Optional[torch.Tensor]:
    """Which assignments an expert capacity keeps: indices (n, k) -> (n, k) bool, None without a capacity.

    GShard (Lepikhin et al. 2021, §2.2) and Switch (Fedus et al. 2022, §2.2) give each expert a capacity of
    C = ceil(capacity_factor · n·k / E) assignments of the rank's n tokens; the assignments beyond C, in (token,
    slot) order, are dropped: that slot adds nothing to the token (its other experts keep their weights, the
    residual carries it). The router statistics and the load-balancing loss still count every choice."""
    if capacity_factor is None:
        return None
    n, k = indices.shape
    capacity = expert_capacity(n * k, num_experts, capacity_factor)
    flat = indices.reshape(-1)  # (a,) assignments in (token, slot) order
    order = torch.argsort(flat, stable=True)  # grouped by expert, in (token, slot) order within each
    counts = torch.bincount(flat, minlength=num_experts)
    first = torch.cumsum(counts, 0) - counts  # (E,) where each expert's group starts in `order`
    place = torch.arange(flat.numel(), device=flat.device) - first[flat[order]]  # position within its expert
    keep = torch.empty_like(flat, dtype=torch.bool)
    keep[order] = place < capacity
    return keep.view(n, k)


def router_tally(aux: torch.Tensor, router_stats: torch.Tensor, num_experts: int) -> torch.Tensor:
    """What a step's metrics need from one loss call, detached: (2 + E,) fp32 [1 call, its load-balancing
    loss, assignments to each expert summed over the layers]. Tallies add up over micro-batches and ranks."""
    one = torch.ones(1, dtype=torch.float32, device=router_stats.device)
    return torch.cat((one, aux.detach().float().reshape(1), router_stats[:num_experts].detach()))


def router_summary(tally: torch.Tensor) -> dict:
    """Summed tallies -> metrics: the mean load-balancing loss (without its coefficient), each expert's share of
    the assignments, and the busiest expert's load relative to a perfectly even split (1.0 = balanced)."""
    calls, aux, counts = tally[0].item(), tally[1].item(), tally[2:]
    share = counts / counts.sum().clamp(min=1)  # (E,)
    return {"aux_loss": aux / max(calls, 1.0), "expert_load": [round(x, 5) for x in share.tolist()],
            "expert_load_max": share.max().item() * len(share)}


class Router(nn.Module):
    """Top-k gating, replicated over TP. "softmax" scoring (`shape.router_scoring`) is HF `MixtralTopKRouter`'s and
    `Qwen3MoeTopKRouter`'s math: logits = x Wᵀ, softmax in fp32, top-k of the probabilities, renormalised by their
    sum (Qwen: only with norm_topk_prob).

    "sigmoid" is DeepSeek-V3's (`DeepseekV3TopkRouter`; DeepSeek-V3 report §2.1.2): logits in fp32 (x and W cast),
    scores sigmoid(logits); the experts are chosen on scores + e_score_correction_bias (an fp32 buffer, moved by
    aux-loss-free balancing, not by gradients), among the `router_topk_groups` of `router_groups` groups whose two
    best biased scores sum highest; the weights are the unbiased scores of the chosen experts, divided by their sum
    (+ 1e-20) with norm_topk_prob, times `routed_scaling_factor`. The load-balancing statistics count the scores."""

    def __init__(self, shape: LlamaShape, device=None, dtype=None):
        super().__init__()
        self.top_k = shape.experts_per_token
        self.renormalize = shape.router_renormalize
        self.sigmoid = shape.router_scoring == "sigmoid"
        self.groups, self.topk_groups = shape.router_groups, shape.router_topk_groups
        self.scaling = shape.routed_scaling_factor
        full = (shape.num_experts, shape.hidden_size)  # (E, h)
        self.weight = nn.Parameter(torch.empty(full, device=device, dtype=dtype))
        init_shard_(self.weight, full, 0, TensorParallelGroup.single(), normal_init(shape.initializer_range))
        self.count_tokens = False  # set by training/expert_bias.py: training forwards add to `token_counts`
        self.token_counts = None  # (E,) fp32, tokens routed to each expert since the last take; not a buffer
        if shape.router_score_bias:  # HF's name; saved with the weights (`tp_plan.BUFFERS`)
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(shape.num_experts, device=device, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def _apply(self, fn, recurse=True):  # the bias stays fp32 under .bfloat16() as HF's (a moved copy, not cast)
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        if bias is not None:
            self.e_score_correction_bias = bias.to(self.e_score_correction_bias.device)
        return self

    def _count(self, indices):
        """Add a training micro-batch's assignments to `token_counts` (index_add: no device-to-host sync). A block
        recomputed under activation checkpointing counts its tokens twice, every micro-batch alike: the balancing
        update reads only the sign of (mean − count), which that does not change."""
        if self.token_counts is None:
            self.token_counts = torch.zeros(self.weight.shape[0], dtype=torch.float32, device=indices.device)
        flat = indices.reshape(-1)
        self.token_counts.index_add_(0, flat, torch.ones(flat.numel(), dtype=torch.float32, device=flat.device))

    def take_token_counts(self) -> torch.Tensor:
        """The counts since the last take, (E,) fp32 (zeros if none), and reset."""
        counts = self.token_counts
        self.token_counts = None
        return counts if counts is not None else torch.zeros(self.weight.shape[0], dtype=torch.float32,
                                                             device=self.weight.device)

    def forward(self, x):  # (n, h) -> probs (n, E) fp32, weights (n, k) fp32, indices (n, k)
        if self.sigmoid:
            return self._sigmoid_route(x)
        logits = F.linear(x, self.weight)  # (n, E)
        probs = torch.softmax(logits.float(), dim=-1)
        top_probs, indices = torch.topk(probs, self.top_k, dim=-1)
        weights = top_probs / top_probs.sum(dim=-1, keepdim=True) if self.renormalize else top_probs
        return probs, weights, indices

    def _sigmoid_route(self, x):
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # (n, E) fp32
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        n, experts = choice.shape
        if self.groups > 1:  # group-limited routing: keep the experts of the best topk_groups groups
            grouped = choice.view(n, self.groups, experts // self.groups)  # (n, G, E/G)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # (n, G): each group's two best
            kept = torch.topk(group_scores, k=self.topk_groups, dim=-1, sorted=False)[1]  # (n, topk_groups)
            group_mask = torch.zeros_like(group_scores).scatter_(1, kept, 1).bool()  # (n, G)
            expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, experts // self.groups).reshape(n, experts)
            choice = choice.masked_fill(~expert_mask, float("-inf"))
        indices = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]  # (n, k)
        if self.count_tokens and self.training and torch.is_grad_enabled():
            self._count(indices)
        weights = scores.gather(1, indices)  # the unbiased scores
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return scores, weights * self.scaling, indices


class Expert(nn.Module):
    """One SwiGLU expert of `width` (a routed expert's f_e, or the shared expert's), split over TP like the dense
    MLP. `MoEFeedForward` runs the TP collectives once for all experts, so it uses these layers' weights directly,
    not their forward."""

    def __init__(self, shape: LlamaShape, tp: TensorParallelGroup, device=None, dtype=None,
                 generator: Optional[torch.Generator] = None, width: Optional[int] = None):
        super().__init__()
        h, f = shape.hidden_size, width or shape.expert_intermediate_size
        kw = dict(device=device, dtype=dtype, init_method=normal_init(shape.initializer_range, generator))
        self.gate_proj = ColumnParallelLinear(h, f, tp, **kw)
        self.up_proj = ColumnParallelLinear(h, f, tp, **kw)
        self.down_proj = RowParallelLinear(f, h, tp, input_is_parallel=True, **kw)

    def partial(self, x):  # (n_e, h) -> (n_e, h), this rank's f/t share of the sum over f
        hidden = F.silu(F.linear(x, self.gate_proj.weight)) * F.linear(x, self.up_proj.weight)  # (n_e, f/t)
        return F.linear(hidden, self.down_proj.weight)


class Experts(nn.Module):
    """The experts this rank holds, registered under their global index as `experts.<e>.{gate,up,down}_proj.weight`:
    one HF expert tensor each, so HF names map the same way whichever experts a rank holds.

    Without expert parallelism every rank holds all E experts and runs them in a loop. With it (`ep.size` > 1)
    it holds E/e of them: the tokens travel to their experts' ranks and back (parallel/expert_parallel.py), and
    each expert parameter is marked as DeepSpeed's MoE layer marks its own (`allreduce = False`, `group_name`),
    so the engine and ZeRO reduce its gradient over the expert-data-parallel group only (ds_internals/experts.py).
    Each expert is drawn from its own generator, seeded from one draw of the layer's stream that every rank
    makes: a rank draws only the experts it holds, and the initial weights still do not depend on e."""

    def __init__(self, shape: LlamaShape, tp: TensorParallelGroup, ep: Optional[ExpertParallelGroup] = None,
                 device=None, dtype=None):
        super().__init__()
        self.tp = tp
        self.ep = ep or ExpertParallelGroup.single()
        self.num_experts = shape.num_experts
        self.requested_kernel = shape.expert_kernel
        self.hidden, self.width = shape.hidden_size, shape.expert_intermediate_size // tp.size  # h, f/t
        # (E,) seeds from the layer's stream, the same on every rank whichever experts it holds
        seeds = torch.randint(2**62, (shape.num_experts,), dtype=torch.int64).tolist()
        for e in self.ep.local_experts(shape.num_experts):
            generator = torch.Generator(draw_device()).manual_seed(seeds[e])
            self.add_module(str(e), Expert(shape, tp, device=device, dtype=dtype, generator=generator))
        contiguous_experts(self.children())  # one buffer: the grouped kernel views it without a copy
        if self.ep.size > 1:
            for param in self.parameters():
                param.allreduce = False  # deepspeed.moe.utils.is_moe_param
                param.group_name = self.ep.name

    def forward(self, x, weights, indices, keep=None):  # (n, h), (n, k) fp32, (n, k), (n, k) bool -> (n, h)
        """This TP rank's partial output, its f/t share of every expert's sum (`MoEFeedForward` sums it over TP and
        holds the f that sums the gradients of x and of the weights). `keep` (`capacity_keep`): the assignments that
        run; the others are sent to expert E, which is none."""
        if keep is not None:
            indices = torch.where(keep, indices, self.num_experts)
        out = torch.zeros_like(x)  # (n, h)
        kernel = self.kernel(x.dtype)[0]
        k = indices.shape[1]
        if self.ep.size > 1:
            rows, per_expert, plan = dispatch(x, indices, self.num_experts, self.ep)  # (r, h) by local expert
            y = combine(run_experts(kernel, rows, per_expert, self.children()), plan)  # (n·k, h): plan.order's
            order = plan.order
            token = order // k  # (n·k,) the token of each row
        else:
            # The assignments sorted by expert (tokens in order within one), as expert-by-expert torch.where gives
            # them; every expert runs, even on no rows: its weights then get a zero gradient, as HF's fused expert
            # tensors do, so optimizers (AdamW's decay and moments) update them alike.
            order, counts = sort_by_expert(indices, self.num_experts)
            token = order // k  # (r,) the token of each row
            y = run_experts(kernel, x.index_select(0, token), counts, self.children())  # (r, h)
        y = y * weights.reshape(-1).index_select(0, order)[:, None]  # fp32
        out.index_add_(0, token, y.to(out.dtype))  # the same order of additions as expert after expert
        return out

    def kernel(self, dtype: torch.dtype) -> tuple[str, str]:
        """(the kernel this rank's experts run in `dtype`, why): `expert_kernels.choose_kernel`."""
        return choose_kernel(self.requested_kernel, self.hidden, self.width, torch.finfo(dtype).bits // 8)


class SharedExpertGate(nn.Module):
    """Qwen2-MoE's per-token scale of the shared expert, sigmoid(x·w_g): w_g (1, h), replicated over TP."""

    def __init__(self, shape: LlamaShape, device=None, dtype=None):
        super().__init__()
        full = (1, shape.hidden_size)
        self.weight = nn.Parameter(torch.empty(full, device=device, dtype=dtype))
        init_shard_(self.weight, full, 0, TensorParallelGroup.single(), normal_init(shape.initializer_range))


class MoEFeedForward(nn.Module):
    """The block's feed-forward in a MoE model: x (b, s, h), router_stats (2E + 1,) or None (the first
    block starts them at zero) -> (b, s, h), router_stats with this layer's sums added.

    With a shared expert (`shape.shared_expert_intermediate_size`; Qwen2-MoE) the output is
    routed(x) + sigmoid(x·w_g) · shared(x), HF's `Qwen2MoeSparseMoeBlock` in its order of additions; without the gate
    (`shape.shared_expert_gate` false) the shared expert's output is added as it is. The shared expert is split over
    TP like the dense MLP, and its partial output joins the routed experts' before their one sum over TP (g); the
    per-token gate (n, 1), computed whole on every rank, multiplies a partial output, so its gradient is summed over
    TP (f) like the experts' input's."""

    def __init__(self, shape: LlamaShape, tp: TensorParallelGroup, ep: Optional[ExpertParallelGroup] = None,
                 device=None, dtype=None):
        super().__init__()
        self.tp = tp
        self.num_experts = shape.num_experts
        self.capacity_factor = shape.expert_capacity_factor
        self.router = Router(shape, device=device, dtype=dtype)
        self.experts = Experts(shape, tp, ep, device=device, dtype=dtype)
        self.shared_expert = None
        self.shared_expert_gate = None
        if shape.shared_expert_intermediate_size:
            self.shared_expert = Expert(shape, tp, device=device, dtype=dtype,
                                        width=shape.shared_expert_intermediate_size)
            if shape.shared_expert_gate:
                self.shared_expert_gate = SharedExpertGate(shape, device=device, dtype=dtype)

    def forward(self, x, router_stats=None):
        b, s, h = x.shape
        flat = x.reshape(b * s, h)  # (n, h), n = b·s
        probs, weights, indices = self.router(flat)  # (n, E), (n, k), (n, k)
        keep = capacity_keep(indices, self.num_experts, self.capacity_factor)  # None: every assignment runs
        tp = self.tp
        x_tp = copy_to_tp_region(flat, tp)  # f: each rank's expert slices give a partial input gradient
        weights = copy_to_tp_region(weights, tp)  # f: so do they for the routing weights
        out = self.experts(x_tp, weights, indices, keep)  # (n, h), this rank's partial sum
        if self.shared_expert is not None:
            shared = self.shared_expert.partial(x_tp)  # (n, h) partial
            if self.shared_expert_gate is not None:
                gate = torch.sigmoid(F.linear(flat, self.shared_expert_gate.weight))  # (n, 1)
                shared = copy_to_tp_region(gate, tp) * shared  # f: the gate's gradient is partial per rank
            out = out + shared
        out = reduce_from_tp_region(out, tp).view(b, s, h)  # g: the sum of the f/t partial outputs
        stats = layer_router_stats(probs, indices)  # (2E + 1,)
        return out, stats if router_stats is None else router_stats + stats
