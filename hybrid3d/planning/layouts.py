"""The layouts the planner tries: (t, p, c, attention over CP, d), the rules that refuse one, and the sequence steps.

Placement (`parallel/layout.py`): rank = ((pipe·d + data)·c + cp)·t + model, so a CP group is t·c consecutive ranks
next to TP, and nodes fill with consecutive ranks. TP's collectives and Ulysses' all-to-alls must stay inside a node:
t·u divides the GPUs per node, u the ranks one all-to-all spans (`activations.ulysses_size`: c with
`context_parallel_comm` "a2a", 1 with "p2p", context_parallel_a2a_size with "a2a+p2p"). A ring's point-to-point
sends may cross nodes (`step_time.Cluster.ring_gbps` prices them). The heads split as `tp_plan.check_split` says: by
t·u, the ring splitting none.
"""

import math
from typing import NamedTuple, Optional

from hybrid3d.errors import LayoutError
from hybrid3d.config.support import check_expert_stages, check_experts
from hybrid3d.model.config import LlamaShape
from hybrid3d.model.tp_plan import check_split
from hybrid3d.parallel.layout import ParallelLayout
from hybrid3d.model.pipe import stage_bounds
from hybrid3d.planning.activations import ulysses_size, uses_ring
from hybrid3d.planning.step_time import Cluster

SEQUENCE_UNIT = 128  # tokens: the step of the longest-sequence search (times what c and t must divide)
ULYSSES_PRODUCT = {"a2a": "tp·cp", "p2p": "tp", "a2a+p2p": "tp·a2a"}  # how a refusal names t·u


class Candidate(NamedTuple):
    """A layout to report: sizes, CP's attention (`comm`, context_parallel_comm; `cp_a2a`, context_parallel_a2a_size,
    1 unless "a2a+p2p"), its name in the refusals and why it is refused (None: it may fit)."""

    tp: int
    pp: int
    cp: int
    dp: int
    comm: str
    cp_a2a: int
    name: str
    reason: Optional[str]


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def cp_label(cp: int, comm: str = "a2a", cp_a2a: int = 1) -> str:
    """CP's attention in the tables: "-" without CP, "a2a" (Ulysses), "p2p" (ring), "a2a<u>+p2p" (both)."""
    if cp == 1:
        return "-"
    return f"a2a{cp_a2a}+p2p" if comm == "a2a+p2p" else comm


def layout_refusal(shape: LlamaShape, tp: int, pp: int, cluster: Cluster, cp: int = 1, comm: str = "a2a",
                   cp_a2a: int = 1, untested_experts: bool = False) -> Optional[str]:
    """Why (t, p, c) with CP attention `comm` (`cp_a2a` Ulysses ranks with "a2a+p2p") cannot run on `cluster`, or
    None: placement (module docstring), the world's split and the heads' (`check_split`), a mixture of experts'
    `expert_parallel_options`."""
    u, what = ulysses_size(cp, comm, cp_a2a), ULYSSES_PRODUCT[comm]
    if tp > cluster.gpus_per_node:
        return f"tp={tp} > {cluster.gpus_per_node} GPUs per node: TP all-reduces would cross nodes"
    if tp * u > cluster.gpus_per_node:
        return f"{what} = {tp * u} > {cluster.gpus_per_node} GPUs per node: the all-to-alls would cross nodes"
    if cluster.gpus_per_node % (tp * u):  # ranks fill nodes in order: some block would straddle two nodes
        return (f"{what} = {tp * u} does not divide {cluster.gpus_per_node} GPUs per node: some TP groups would "
                "cross nodes (parallel/placement.py)")
    ring = uses_ring(cp, comm)
    try:
        ParallelLayout(tp, pp, cluster.gpus // (tp * pp * cp), cp=cp, ring=ring, cp_a2a=u if ring else 1)
        check_split(shape, tp, pp, cp, ring=ring, cp_a2a=u)  # a % (t·u); a TP rank's kv heads and u divide one another
        if not expert_parallel_options(shape, tp, pp, cp, cluster.gpus // (tp * pp * cp), untested_experts):
            check_experts(shape.num_experts, tp, pp, cp, 1)  # no e runs: the support table's line for e = 1
    except LayoutError as e:
        return str(e)
    return None


def expert_parallel_options(shape: LlamaShape, tp: int, pp: int, cp: int, dp: int,
                            untested: bool = False) -> list[int]:
    """The expert-parallel sizes e a mixture-of-experts layout may take: e | d and E (whole experts per rank,
    `tp_plan.check_split`), a (t, p, e) the support table runs (`check_experts`; with `untested` any, as a question
    of memory only) and, under a pipeline, a MoE block on every cost-cut stage (`check_expert_stages`); [1] for a
    dense model."""
    if not shape.is_moe:
        return [1]
    options = []
    for ep in divisors(dp):
        if shape.num_experts % ep:
            continue
        try:
            if not untested:
                check_experts(shape.num_experts, tp, pp, cp, ep)
            check_expert_stages(shape, pp, ep, stage_bounds(shape, pp))
        except LayoutError:
            continue
        options.append(ep)
    return options


def hybrid_a2a_size(shape: LlamaShape, tp: int, pp: int, cluster: Cluster, cp: int) -> Optional[int]:
    """u for "a2a+p2p" at (t, p, c): the largest divisor of c with 1 < u < c that Ulysses allows (heads, kv heads
    and a node for its all-to-alls), None if none does."""
    allowed = [u for u in divisors(cp) if 1 < u < cp
               and layout_refusal(shape, tp, pp, cluster, cp, "a2a+p2p", u) is None]
    return max(allowed, default=None)


def ring_options(shape: LlamaShape, tp: int, pp: int, cluster: Cluster, cp: int) -> list[tuple[str, int]]:
    """(comm, cp_a2a) of the ring layouts at (t, p, c > 1): "p2p", and "a2a+p2p" with `hybrid_a2a_size` if any."""
    u = hybrid_a2a_size(shape, tp, pp, cluster, cp)
    return [("p2p", 1)] + ([("a2a+p2p", u)] if u else [])


def sequence_unit(tp: int, cp: int, sp: bool, ring: bool = False) -> int:
    """The longest-sequence search's step: 128 tokens times what must divide s (`config.ds_checks.
    check_sequence_splits`): c, 2c with a ring (2c chunks, `parallel/ring_attention.py`), times t with SP."""
    return math.lcm(SEQUENCE_UNIT, cp * (2 if ring else 1) * (tp if sp else 1))


def _candidate(shape: LlamaShape, cluster: Cluster, global_batch: int, tp: int, pp: int, cp: int, comm: str,
               cp_a2a: int, base: Optional[str], untested_experts: bool = False) -> Candidate:
    """The layout, named as in the refusals, with its refusal (`base`: the one without CP)."""
    dp = cluster.gpus // (tp * pp * cp)
    context = (f" CP{cp}" + ("" if comm == "a2a" else f" {cp_label(cp, comm, cp_a2a)}")) if cp > 1 else ""
    reason = base if cp == 1 else layout_refusal(shape, tp, pp, cluster, cp, comm, cp_a2a, untested_experts)
    if reason is None and global_batch % dp:
        reason = f"global batch {global_batch} is not divisible by dp={dp}"
    return Candidate(tp, pp, cp, dp, comm, cp_a2a, f"TP{tp} PP{pp}{context} DP{dp}", reason)


def enumerate_layouts(shape: LlamaShape, cluster: Cluster, global_batch: int, context_parallel: bool = True,
                      rings: bool = False, untested_experts: bool = False):
    """Candidates of every layout to report: t | GPUs, p | GPUs/t, c | GPUs/(t·p) (c = 1 only unless
    `context_parallel`), Ulysses for each c and, with `rings`, the ring options of each c > 1 (`ring_options`). CP
    variants of a layout refused without CP, and Ulysses ones with t·c > GPUs per node, are left out: one line says
    so for the latter (the rings of those stay: their sends may cross nodes). `untested_experts`: a mixture of
    experts at layouts the support table does not run yet (`expert_parallel_options`)."""
    skipped = False
    for tp in divisors(cluster.gpus):
        for pp in divisors(cluster.gpus // tp):
            base = layout_refusal(shape, tp, pp, cluster, untested_experts=untested_experts)
            for cp in divisors(cluster.gpus // (tp * pp)) if context_parallel else (1,):
                if cp > 1 and base:
                    continue
                if cp == 1 or tp * cp <= cluster.gpus_per_node:
                    yield _candidate(shape, cluster, global_batch, tp, pp, cp, "a2a", 1, base, untested_experts)
                else:
                    skipped = True
                for comm, cp_a2a in ring_options(shape, tp, pp, cluster, cp) if rings and cp > 1 else ():
                    yield _candidate(shape, cluster, global_batch, tp, pp, cp, comm, cp_a2a, base, untested_experts)
    if skipped:
        rest = "others not listed" + (" (their rings are)" if rings else "")
        yield Candidate(0, 0, 0, 0, "a2a", 1, "CP > 1", (f"only with tp·cp <= {cluster.gpus_per_node} GPUs per node "
                                                        f"(Ulysses all-to-alls inside a node); {rest}"))
